"""The cost of LoRA on the experts (issue 27), each a ratio measured in one run: a Qwen3-MoE
sparse block forward + backward in one process (ep 1; benches/moe.py's shapes and weights) with
its weights frozen, per dispatcher:
1. with rank-r LoRA on both expert weights (fsdpturbo.moe.expert_lora: two rank-r matmuls per
   weight on the routed rows, the adapters' gradients) against the same block without adapters
   (the frozen-expert step, as LoRA on attention alone trains a MoE layer);
2. for scale, full training of the block (every weight's gradient) against the frozen step.
Rounds alternate between the variants, so load from other sessions falls on each alike.
Run: PYTHONPATH=torch_ext/python:benches .venv/bin/python benches/expert_lora.py
"""
import os
import statistics
import time

import torch
import torch.distributed as dist

from moe import block_step

ROUNDS, RANKS = 7, (8, 16, 64)


def alternated(steps, rounds):
    """{name: median seconds} of each step, run once per round in turn after one warm-up each."""
    times = {name: [] for name in steps}
    for step in steps.values():
        step()
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29519")
    dist.init_process_group("gloo", rank=0, world_size=1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; block fwd+bwd (2048 tokens, H=512, "
          f"I=256, 16 experts, top-4), f32, median of {ROUNDS} alternated rounds")
    print(f"{'dispatcher':<10} {'frozen ms':>10} " + " ".join(f"{f'LoRA r={r}':>13}" for r in RANKS)
          + f" {'full training':>14}")
    for dispatcher in ("eager", "fused"):
        steps = {"frozen": block_step(dispatcher, torch.float32, trained=False),
                 **{r: block_step(dispatcher, torch.float32, trained=False, lora_rank=r) for r in RANKS},
                 "full": block_step(dispatcher, torch.float32)}
        t = alternated(steps, ROUNDS)
        cells = [f"{t[name] * 1e3:6.1f} {t[name] / t['frozen']:4.2f}x" for name in (*RANKS, "full")]
        print(f"{dispatcher:<10} {t['frozen'] * 1e3:>10.1f} " + " ".join(f"{c:>13}" for c in cells[:-1])
              + f" {cells[-1]:>14}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
