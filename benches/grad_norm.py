"""Host gradient-norm benchmark: the fused p-norm kernel against torch, in one run on CPU.

    FSDPTURBO_LIB=target/release/libfsdpturbo.so \
    FSDPTURBO_TORCH_LIB=build/torch_ext/libfsdpturbo_torch.so PYTHONPATH=torch_ext/python \
    python benches/grad_norm.py [--tensors 300] [--mb 256] [--reps 10] [--dtype bf16]

Measures, over the same `--tensors` gradients totalling `--mb` MB (sizes vary between tensors,
as a model's do):
  * the p = 2 total norm: `torch.ops.fsdpturbo.power_sum` (+ sqrt) vs `torch._foreach_norm`
    (+ the final `vector_norm` of the stacked norms, i.e. torch's `get_total_norm`) vs a
    per-parameter `torch.linalg.vector_norm` loop;
  * the whole single-rank clip: `fsdpturbo.clip_grad_norm_` vs
    `torch.nn.utils.clip_grad_norm_(foreach=True)` (gradients restored, untimed, before each
    repetition, so every repetition reads and scales the same data).
GB/s counts the gradient bytes read once (a clip also writes them: its GB/s is bytes / time, not
traffic). Ratios are against torch's foreach path, measured in the same run; the cases run
interleaved, round after round, and the table gives the median and the minimum of `--reps`.
"""
import argparse
import os
import statistics
import time

import torch

import fsdpturbo

_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def _make(n_tensors, total_bytes, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(n_tensors, generator=gen) + 0.1
    elem = torch.tensor([], dtype=dtype).element_size()
    total = total_bytes // elem
    sizes = (weights / weights.sum() * total).long().clamp(min=1)
    sizes[-1] += total - int(sizes.sum())
    return [torch.randn(int(n), generator=gen).to(dtype) * 1e-3 for n in sizes]


def _time_interleaved(cases, reps):
    """Runs every case once per round, `reps` rounds after two warm-up rounds, so that load
    changes on a shared machine hit every case alike. cases: [(fn, setup or None)]. Returns,
    per case, (median, min) seconds."""
    times = [[] for _ in cases]
    for r in range(reps + 2):
        for i, (fn, setup) in enumerate(cases):
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if r >= 2:
                times[i].append(dt)
    return [(statistics.median(t), min(t)) for t in times]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--mb", type=float, default=256)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    args = ap.parse_args()
    dtype = _DTYPES[args.dtype]
    nbytes = int(args.mb * 2**20)
    grads = _make(args.tensors, nbytes, dtype)
    gbytes = sum(g.numel() * g.element_size() for g in grads) / 1e9
    ops = torch.ops.fsdpturbo

    def ours_norm():
        return ops.power_sum(grads, 2.0, True).sqrt()

    def foreach_norm():
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)

    def loop_norm():
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads]), 2.0)

    exact = float(torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads])))
    values = {"power_sum": float(ours_norm()), "_foreach_norm": float(foreach_norm()), "loop": float(loop_norm())}

    # Whole clip, single rank: parameters holding the gradients; restore before each repetition.
    saved = [g.clone() for g in grads]
    params = []
    for g in grads:
        q = torch.nn.Parameter(torch.empty_like(g))  # never touched: its pages stay uncommitted
        q.grad = g
        params.append(q)
    max_norm = 0.5 * exact

    def restore():
        torch._foreach_copy_(grads, saved)

    clip_values = {}

    def ours_clip():
        clip_values["ours"] = float(fsdpturbo.clip_grad_norm_(params, max_norm))

    def torch_clip():
        clip_values["torch"] = float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True))

    names = ["p-norm: fsdpturbo power_sum", "p-norm: torch._foreach_norm + sum",
             "p-norm: per-parameter vector_norm", "clip: fsdpturbo.clip_grad_norm_",
             "clip: torch clip_grad_norm_(foreach=True)"]
    timings = _time_interleaved([(ours_norm, None), (foreach_norm, None), (loop_norm, None),
                                 (ours_clip, restore), (torch_clip, restore)], args.reps)

    print(f"# grad-norm benchmark: {args.tensors} tensors, {gbytes * 1e3:.0f} MB of {args.dtype}, "
          f"{args.reps} interleaved rounds")
    print(f"# torch {torch.__version__}, torch threads {torch.get_num_threads()}, "
          f"cpus usable {len(os.sched_getaffinity(0))} of {os.cpu_count()}, "
          f"load average {os.getloadavg()[0]:.1f}, fsdpturbo {fsdpturbo.__version__}")
    print(f"# exact (f64) norm {exact:.9g}; power_sum {values['power_sum']:.9g} "
          f"(rel {abs(values['power_sum'] - exact) / exact:.1e}); _foreach_norm {values['_foreach_norm']:.9g} "
          f"(rel {abs(values['_foreach_norm'] - exact) / exact:.1e}); clip: ours {clip_values['ours']:.9g}, "
          f"torch {clip_values['torch']:.9g}")
    print()
    print("| what | median ms | min ms | GB/s (median) | × torch foreach (median) | × (min) |")
    print("|---|---:|---:|---:|---:|---:|")
    for i, (name, (med, best)) in enumerate(zip(names, timings)):
        ref_med, ref_best = timings[1] if i < 3 else timings[4]
        print(f"| {name} | {med * 1e3:.1f} | {best * 1e3:.1f} | {gbytes / med:.1f} | {ref_med / med:.2f} | "
              f"{ref_best / best:.2f} |")


if __name__ == "__main__":
    main()
