"""The compile and capacity modes of the MoE block (issue 14), each a ratio measured in one run:
a Qwen3-MoE sparse block forward + backward in one process (ep 1; benches/moe.py's shapes), per
dispatcher:
1. torch.compile (inductor) against the same block in eager mode;
2. the capacity-bounded dispatch (capacity factor 1.25 and 2, drop) against the dropless one,
   eager and compiled;
3. on CUDA: the capacity block's forward + backward captured in one CUDA graph and replayed,
   against launching it eagerly.
Run: PYTHONPATH=torch_ext/python .venv/bin/python benches/moe_modes.py [--device cuda] [--dtype bfloat16]
"""
import argparse
import os

import torch
import torch.distributed as dist

from fsdpturbo.moe.dispatch import Capacity
from moe import block_step, median_seconds

REPEATS = 7


def graphed(step):
    """`step` captured in a CUDA graph after a warm-up on a side stream: replaying it reruns the
    captured kernels on the same buffers."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(set_to_none=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(set_to_none=False)
    return graph.replay


def timed(step, device):
    if device == "cuda":
        def synchronized():
            step()
            torch.cuda.synchronize()
        return median_seconds(synchronized, REPEATS)
    return median_seconds(step, REPEATS)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29518")
    dist.init_process_group("gloo" if args.device == "cpu" else "nccl", rank=0, world_size=1)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {args.device}, {args.dtype}, {torch.get_num_threads()} threads; "
          f"block fwd+bwd (2048 tokens, H=512, I=256, 16 experts, top-4), median of {REPEATS}")
    print(f"{'dispatcher':<10} {'mode':<17} {'eager ms':>9} {'compiled ms':>12} {'compiled/eager':>15} "
          f"{'vs dropless':>12}")
    for dispatcher in ("eager", "fused", "domino"):
        dropless = None
        for mode, capacity in (("dropless", None), ("capacity 1.25", Capacity(factor=1.25)),
                               ("capacity 2", Capacity(factor=2.0))):
            if capacity is not None and dispatcher == "domino":
                continue  # domino has no capacity mode
            eager = timed(block_step(dispatcher, dtype, capacity=capacity, device=args.device), args.device)
            torch._dynamo.reset()  # each variant compiles afresh (one process holds them all)
            compiled = timed(block_step(dispatcher, dtype, capacity=capacity, device=args.device, compiled=True),
                             args.device)
            dropless = dropless or eager
            print(f"{dispatcher:<10} {mode:<17} {eager * 1e3:9.1f} {compiled * 1e3:12.1f} "
                  f"{eager / compiled:14.2f}x {dropless / eager:11.2f}x")
            if capacity is not None and args.device == "cuda":
                replay = timed(graphed(block_step(dispatcher, dtype, capacity=capacity, device="cuda")), "cuda")
                print(f"{'':<10} {mode + ' graph':<17} replay {replay * 1e3:.2f} ms, eager launch "
                      f"{eager * 1e3:.2f} ms: {eager / replay:.2f}x")
    print("compiled/eager > 1: compiled is faster; vs dropless > 1: the capacity mode is faster than the "
          "dropless dispatch in eager mode")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
