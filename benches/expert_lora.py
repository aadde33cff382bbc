"""The cost of LoRA on the experts (issue 27), each a ratio measured in one run: a Qwen3-MoE
sparse block forward + backward in one process (ep 1; benches/moe.py's shapes and weights) with
its weights frozen, per dispatcher:
1. with rank-r LoRA on both expert weights (fsdpturbo.moe.expert_lora: two rank-r matmuls per
   weight on the routed rows, the adapters' gradients) against the same block without adapters
   (the frozen-expert step, as LoRA on attention alone trains a MoE layer);
2. for scale, full training of the block (every weight's gradient) against the frozen step;
3. the adapter's two rank-r grouped GEMMs alone (down: [rows, H] × [E, r, H]ᵀ, up: [rows, r] ×
   [E, H, r]ᵀ; forward + backward, equal groups) with the op library's `grouped_mm` against
   torch's `bmm` on the same shapes.
Rounds alternate between the variants, so load from other sessions falls on each alike.
Run: PYTHONPATH=torch_ext/python:benches .venv/bin/python benches/expert_lora.py
"""
import os
import statistics
import time

import torch
import torch.distributed as dist

from fsdpturbo._native import ops
from moe import block_step

ROUNDS, RANKS = 7, (8, 16, 64)
EXPERTS, ROWS_PER_EXPERT, HIDDEN = 16, 512, 512


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
    rank_gemms()
    dist.destroy_process_group()


def gemm_step(x, weight, grouped):
    """Forward + backward of `x` [E·rows, in] times each expert's `weight` [E, out, in]ᵀ."""
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    counts = torch.full((EXPERTS,), ROWS_PER_EXPERT, dtype=torch.int64)

    def step():
        if grouped:
            y = ops.grouped_mm(x, counts, weight)
        else:
            y = torch.bmm(x.view(EXPERTS, ROWS_PER_EXPERT, -1), weight.transpose(1, 2)).view(x.shape[0], -1)
        y.backward(torch.ones_like(y))
    return step


def rank_gemms():
    """Table 3: the adapter's rank-r GEMMs, `grouped_mm` against `bmm`."""
    print(f"\nthe rank-r grouped GEMMs alone ({EXPERTS} experts x {ROWS_PER_EXPERT} rows, H={HIDDEN}), "
          f"forward + backward, median of {ROUNDS} alternated rounds")
    print(f"{'r':>4} {'GEMM':<28} {'grouped_mm ms':>14} {'bmm ms':>8} {'ratio':>6}")
    g = torch.Generator().manual_seed(0)
    rows = EXPERTS * ROWS_PER_EXPERT
    for r in RANKS:
        shapes = {f"down [{rows}, {HIDDEN}] x [{EXPERTS}, {r}, {HIDDEN}]^T": (HIDDEN, r),
                  f"up [{rows}, {r}] x [{EXPERTS}, {HIDDEN}, {r}]^T": (r, HIDDEN)}
        for label, (fan_in, fan_out) in shapes.items():
            x = torch.randn(rows, fan_in, generator=g)
            w = torch.randn(EXPERTS, fan_out, fan_in, generator=g) * 0.02
            t = alternated({"ours": gemm_step(x, w, True), "bmm": gemm_step(x, w, False)}, ROUNDS)
            print(f"{r:>4} {label:<28} {t['ours'] * 1e3:>14.2f} {t['bmm'] * 1e3:>8.2f} {t['bmm'] / t['ours']:>5.2f}x")


if __name__ == "__main__":
    main()
