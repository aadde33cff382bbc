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
traffic). Ratios are against torch's foreach path, measured in the same run. Medians of `--reps`.
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


def _time(fn, reps, setup=None):
    times = []
    for i in range(reps + 2):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if i >= 2:  # two warm-up runs
            times.append(dt)
    return statistics.median(times)


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

    rows = [("p-norm: fsdpturbo power_sum", _time(ours_norm, args.reps), values["power_sum"]),
            ("p-norm: torch._foreach_norm + sum", _time(foreach_norm, args.reps), values["_foreach_norm"]),
            ("p-norm: per-parameter vector_norm", _time(loop_norm, args.reps), values["loop"])]

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

    rows.append(("clip: fsdpturbo.clip_grad_norm_", _time(ours_clip, args.reps, restore), None))
    rows.append(("clip: torch clip_grad_norm_(foreach=True)", _time(torch_clip, args.reps, restore), None))

    print(f"# grad-norm benchmark: {args.tensors} tensors, {gbytes * 1e3:.0f} MB of {args.dtype}, "
          f"median of {args.reps}")
    print(f"# torch {torch.__version__}, torch threads {torch.get_num_threads()}, cpu_count {os.cpu_count()}, "
          f"fsdpturbo {fsdpturbo.__version__}")
    print(f"# exact (f64) norm {exact:.9g}; power_sum {values['power_sum']:.9g} "
          f"(rel {abs(values['power_sum'] - exact) / exact:.1e}); _foreach_norm {values['_foreach_norm']:.9g} "
          f"(rel {abs(values['_foreach_norm'] - exact) / exact:.1e}); clip: ours {clip_values['ours']:.9g}, "
          f"torch {clip_values['torch']:.9g}")
    print()
    print("| what | ms | GB/s | × torch foreach |")
    print("|---|---:|---:|---:|")
    ref_norm = rows[1][1]
    ref_clip = rows[4][1]
    for i, (name, t, _) in enumerate(rows):
        ref = ref_norm if i < 3 else ref_clip
        print(f"| {name} | {t * 1e3:.1f} | {gbytes / t:.1f} | {ref / t:.2f} |")


if __name__ == "__main__":
    main()
