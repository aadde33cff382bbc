"""Benchmark: loading one rank's slice of a full checkpoint tensor on the host.

Compares, in one run and on the same buffers:
  * ours   - `torch.ops.fsdpturbo.copy_slice_` (the Rust copy plan: one memcpy per contiguous
             run; what `fsdpturbo.copy_weights_` runs for a CPU checkpoint tensor);
  * narrow - `local.copy_(full.narrow(...).narrow(...))`, the seed's `_copy_weights` way;
  * memcpy - `ctypes.memmove` of the same byte count between two contiguous buffers (the
             ceiling: the slice is at best one memcpy).
GB/s counts the local tensor's bytes once; "of memcpy" is memcpy's time over the method's.
Each figure is the minimum (or, with --stat median, the median) of --repeats runs timed
round-robin (rotating which method goes first) after a warm-up; torch runs on --threads threads (memcpy and ours are
single-threaded).

Usage: PYTHONPATH=torch_ext/python python benches/copy_weights.py [--repeats N] [--threads T]
"""
import argparse
import ctypes
import math
import statistics
import time

import torch

import fsdpturbo
from fsdpturbo.placement import _triples
from torch.distributed.tensor import Replicate, Shard

ops = torch.ops.fsdpturbo

# (name, global shape, mesh shape, coordinate, placements)
CASES = [
    ("gate_up_proj [128,1536,2048] ep=8 (block)", (128, 1536, 2048), (8,), (3,), [Shard(0)]),
    ("gate_up_proj efsdp=4 on dim 1, ep=8 (runs)", (128, 1536, 2048), (4, 8), (1, 3), [Shard(1), Shard(0)]),
    ("embedding [151936,2048] dp=32 (block)", (151936, 2048), (32,), (5,), [Shard(0)]),
    ("down_proj [128,2048,768] efsdp=4 x ep=8", (128, 2048, 768), (4, 8), (2, 5), [Shard(1), Shard(0)]),
    ("embedding [151936,2048] tp=8 on dim 1 (rows)", (151936, 2048), (2, 8), (0, 3), [Replicate(), Shard(1)]),
]


def _seconds(fns, repeats, stat):
    """Seconds of each function (min or median over `repeats` runs), timed round-robin with the
    starting function rotating every round (so that load from other processes and the cache
    state left by the previous copy hit all of them alike), after one warm-up round."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for r in range(repeats):
        for i in range(len(fns)):
            k = (r + i) % len(fns)
            start = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - start)
    return [(min if stat == "min" else statistics.median)(t) for t in times]


def _narrow_fn(local, full, offset, shape):
    view = full
    for d, (o, n) in enumerate(zip(offset, shape)):
        if n != full.shape[d]:
            view = view.narrow(d, o, n)
    return lambda: local.copy_(view)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--stat", choices=["min", "median"], default="min",
                        help="min (default: the least disturbed run on a shared host) or median")
    parser.add_argument("--only", default="", help="run only the cases whose name contains this text")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16
    print(f"torch {torch.__version__}, {dtype}, torch threads {torch.get_num_threads()}, "
          f"{args.stat} of {args.repeats} round-robin runs")
    header = f"{'case':46} {'local MB':>9} {'runs':>6} | {'ours GB/s':>9} {'narrow GB/s':>11} {'memcpy GB/s':>11} | " \
             f"{'ours/memcpy':>11} {'narrow/memcpy':>13}"
    print(header)
    print("-" * len(header))
    full_cache = {}
    for name, global_shape, mesh_shape, coordinate, placements in CASES:
        if args.only not in name:
            continue
        if global_shape not in full_cache:
            full_cache.clear()
            full_cache[global_shape] = torch.empty(global_shape, dtype=dtype).random_(-100, 100)
        full = full_cache[global_shape]
        shape, offset = fsdpturbo.local_shape_and_offset(global_shape, mesh_shape, coordinate, placements)
        triples = _triples(placements, len(global_shape), "bench")
        local = torch.empty(shape, dtype=dtype)
        nbytes = local.numel() * local.element_size()
        # Contiguous runs of the slice (the innermost sharded dim cuts the rows).
        last = max((p.dim for p in placements if isinstance(p, Shard)), default=-1)
        runs = 1 if last <= 0 else local.numel() // math.prod(shape[last:])

        first = sum(o * st for o, st in zip(offset, full.stride()))  # the slice's first element
        src = full.view(-1)[first: first + local.numel()]  # contiguous, same byte count, same region
        expected = torch.empty_like(local)
        _narrow_fn(expected, full, offset, shape)()
        fns = [lambda: ops.copy_slice_(local, full, list(mesh_shape), list(coordinate), triples),
               _narrow_fn(local, full, offset, shape),
               lambda: ctypes.memmove(local.data_ptr(), src.data_ptr(), nbytes)]
        ours, narrow, memcpy = _seconds(fns, args.repeats, args.stat)
        ops.copy_slice_(local, full, list(mesh_shape), list(coordinate), triples)
        assert torch.equal(local, expected), name
        gbs = lambda t: nbytes / t / 1e9  # noqa: E731
        print(f"{name:46} {nbytes / 1e6:9.1f} {runs:6d} | {gbs(ours):9.2f} {gbs(narrow):11.2f} {gbs(memcpy):11.2f} | "
              f"{memcpy / ours:10.0%} {memcpy / narrow:13.0%}")


if __name__ == "__main__":
    main()
