"""CUDA benchmarks of the op library against the torch references they replace, at the
Qwen3-30B-A3B shapes at EP8 (H=2048, I=768, 16 local experts, 16384 tokens x top-8, bf16), on
fresh random data. Prints one table (GB/s or TFLOP/s, the ratio to the reference measured in the
same run, and the fraction of the measured copy / GEMM ceilings) and writes it as JSON.

    python benches/cuda_moe.py [--json out.json] [--quick]

Timing: CUDA events around each call, warm-up first, median of the repeats; every case runs
round-robin with its reference so clock drift hits both. Each case also checks its result
against the reference (rel. error printed; NaN or > tolerance fails the run: exit 1).
"""
import argparse
import json
import math
import os
import statistics
import sys

import torch

import fsdpturbo

ops = fsdpturbo.ops
DEV = "cuda"
H, I, E, TOKENS, TOP_K = 2048, 768, 16, 16384, 8


def timed(fn, repeat):
    """Median milliseconds of `repeat` calls (after 3 warm-ups)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


ROWS = []
FAILED = []


def row(name, unit, amount, ours_ms, ref_name, ref_ms, ceiling, err, tol, target=None):
    ours, ref = amount / ours_ms / 1e6, amount / ref_ms / 1e6  # GB/s or TFLOP/s from bytes/flops per ms
    if unit == "TFLOP/s":
        ours, ref = ours / 1e3, ref / 1e3
    ok = math.isfinite(err) and err <= tol
    if not ok:
        FAILED.append(name)
    ROWS.append(dict(case=name, unit=unit, ours=ours, reference=ref_name, ref=ref, ratio=ref_ms / ours_ms,
                     ceiling_fraction=ours / ceiling, rel_err=err, ok=ok, target=target))


def ceilings(repeat):
    n = 1 << 30
    src = torch.randn(n // 2, device=DEV, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = timed(lambda: dst.copy_(src), repeat)
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    mm_ms = timed(lambda: a @ b, repeat)
    return 2 * n / copy_ms / 1e6, 2 * 8192**3 / mm_ms / 1e9


def routing(gen, tokens, skew=False):
    if skew:  # most tokens on a few experts, experts 3 and 11 empty
        weights = torch.tensor([8.0 if e in (0, 1, 2) else (0.0 if e in (3, 11) else 1.0) for e in range(E)], device=DEV)
    else:
        weights = torch.ones(E, device=DEV)
    return torch.multinomial(weights.expand(tokens, E), TOP_K, replacement=False, generator=gen)


def bench_permute(gen, copy_bw, repeat):
    x = torch.randn(TOKENS, H, device=DEV, generator=gen, dtype=torch.bfloat16)
    ids = routing(gen, TOKENS)

    def ours():
        _, perm, _ = ops.moe_route(ids, E, 1)
        return ops.moe_permute(x, perm, TOP_K)

    def reference():
        perm = torch.argsort(ids.reshape(-1), stable=True)
        torch.bincount(ids.reshape(-1), minlength=E)
        return x.index_select(0, perm // TOP_K)

    err = rel(ours(), reference())
    nbytes = 2 * TOKENS * TOP_K * H * 2
    t_ours, t_ref = timed(ours, repeat), timed(reference, repeat)
    row("permute (route + gather)", "GB/s", nbytes, t_ours, "argsort + index_select", t_ref, copy_bw, err, 0.0,
        ">= 3300 GB/s")
    _, perm, _ = ops.moe_route(ids, E, 1)
    t_ours, t_ref = timed(lambda: ops.moe_permute(x, perm, TOP_K), repeat), timed(
        lambda: x.index_select(0, perm // TOP_K), repeat)
    row("permute (gather only)", "GB/s", nbytes, t_ours, "index_select", t_ref, copy_bw, 0.0, 0.0)


def bench_unpermute(gen, copy_bw, repeat):
    ids = routing(gen, TOKENS)
    _, perm, _ = ops.moe_route(ids, E, 1)
    y = torch.randn(TOKENS * TOP_K, H, device=DEV, generator=gen, dtype=torch.bfloat16)
    probs = torch.rand(TOKENS, TOP_K, device=DEV, generator=gen, dtype=torch.bfloat16)
    token_of_row = perm // TOP_K
    slot_w = probs.reshape(-1).index_select(0, perm)

    def ours():
        return ops.moe_unpermute(y, perm, probs, TOKENS, TOP_K)

    def reference():
        out = torch.zeros(TOKENS, H, device=DEV, dtype=torch.bfloat16)
        return out.index_add_(0, token_of_row, y * slot_w.unsqueeze(-1))

    err = rel(ours(), reference())
    nbytes = (TOKENS * TOP_K + TOKENS) * H * 2
    row("unpermute + combine", "GB/s", nbytes, timed(ours, repeat), "index_add", timed(reference, repeat), copy_bw,
        err, 1e-2, ">= 3000 GB/s")


def bench_grad_norm(gen, copy_bw, repeat):
    sizes = [4_194_304] * 112 + [1_503_232] * 224  # 336 tensors, 806M elements, 1.6 GB of bf16
    ts = [torch.randn(n, device=DEV, generator=gen, dtype=torch.bfloat16) for n in sizes]
    nbytes = sum(sizes) * 2

    def ours():
        return ops.power_sum(ts, 2.0, True).sqrt()

    def loop():
        return torch.stack([torch.linalg.vector_norm(t, 2, dtype=torch.float32) for t in ts]).norm()

    def foreach():
        return torch.stack(torch._foreach_norm(ts, 2)).norm()

    exact = torch.stack([t.double().norm() for t in ts]).norm()
    err = rel(ours(), exact)
    t_ours = timed(ours, repeat)
    row("grad norm, 336 bf16 tensors", "GB/s", nbytes, t_ours, "per-parameter loop", timed(loop, repeat), copy_bw, err,
        1e-6, ">= 3300 GB/s")
    row("grad norm, 336 bf16 tensors", "GB/s", nbytes, t_ours, "torch._foreach_norm", timed(foreach, repeat), copy_bw,
        rel(foreach(), exact), 1e-3)


def bench_grouped_mm(gen, gemm_rate, repeat, skew, monkey_env):
    ids = routing(gen, TOKENS, skew=skew)
    counts, perm, _ = ops.moe_route(ids, E, 1)
    n = TOKENS * TOP_K
    x = torch.randn(n, H, device=DEV, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(E, 2 * I, H, device=DEV, generator=gen, dtype=torch.bfloat16) / math.sqrt(H)
    flops = 2 * n * H * 2 * I
    host = counts.tolist()

    def loop():
        outs, start = [], 0
        for g, c in enumerate(host):
            outs.append(x[start:start + c] @ w[g].t())
            start += c
        return torch.cat(outs)

    ref = loop()
    offs = torch.cumsum(counts, 0).to(torch.int32)
    label = "skewed, 2 empty experts" if skew else "balanced"
    t_loop = timed(loop, repeat)
    for path in ("auto", "cublas", "cublas_loop", "torch"):
        if path == "torch" and torch.cuda.get_device_capability() < (9, 0):
            continue
        monkey_env(path)
        got = ops.grouped_mm(x, counts, w)
        row(f"grouped GEMM {label} [{path}]", "TFLOP/s", flops, timed(lambda: ops.grouped_mm(x, counts, w), repeat),
            "per-expert loop", t_loop, gemm_rate, rel(got, ref), 2e-2,
            (">= 700 TFLOP/s" if not skew else ">= 1.3x loop") if path == "auto" else None)
    monkey_env("auto")
    if hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability() >= (9, 0):
        t = timed(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs), repeat)
        row(f"grouped GEMM {label} [torch._grouped_mm direct]", "TFLOP/s", flops, t, "per-expert loop", t_loop, gemm_rate,
            rel(torch._grouped_mm(x, w.transpose(-2, -1), offs), ref), 2e-2)


class _Experts(torch.nn.Module):
    def __init__(self, gen):
        super().__init__()
        self.gate_up = torch.nn.Parameter(torch.randn(E, 2 * I, H, device=DEV, generator=gen, dtype=torch.bfloat16) * 0.02)
        self.down = torch.nn.Parameter(torch.randn(E, H, I, device=DEV, generator=gen, dtype=torch.bfloat16) * 0.02)


def moe_fused(m, x, ids, probs):
    counts, perm, _ = ops.moe_route(ids, E, 1)
    h = ops.moe_permute(x, perm, TOP_K)
    gate, up = ops.grouped_mm(h, counts, m.gate_up).chunk(2, dim=-1)
    out = ops.grouped_mm((torch.nn.functional.silu(gate) * up).contiguous(), counts, m.down)
    return ops.moe_unpermute(out, perm, probs, x.size(0), TOP_K)


def moe_eager(m, x, ids, probs):
    """The per-expert loop of HF's eager experts and the seed's eager dispatcher."""
    out = torch.zeros_like(x)
    for e in range(E):
        token, k = torch.where(ids == e)
        if token.numel() == 0:
            continue
        gate, up = (x[token] @ m.gate_up[e].t()).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ m.down[e].t()
        out.index_add_(0, token, y * probs[token, k].unsqueeze(-1))
    return out


def bench_moe_layer(gen, gemm_rate, repeat):
    m = _Experts(gen)
    x = torch.randn(TOKENS, H, device=DEV, generator=gen, dtype=torch.bfloat16)
    ids = routing(gen, TOKENS)
    probs = torch.rand(TOKENS, TOP_K, device=DEV, generator=gen, dtype=torch.bfloat16)
    cot = torch.randn(TOKENS, H, device=DEV, generator=gen, dtype=torch.bfloat16)

    def step(fn):
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        out = fn(m, xi, ids, probs)
        out.backward(cot)
        return out.detach(), xi.grad, m.gate_up.grad, m.down.grad

    fused, eager = step(moe_fused), step(moe_eager)
    err = max(rel(a, b) for a, b in zip(fused, eager))
    again = step(moe_fused)
    deterministic = all(torch.equal(a, b) for a, b in zip(fused, again))
    flops = 3 * 2 * TOKENS * TOP_K * H * 3 * I  # forward + 2x backward, three GEMMs of H x I per row
    row("MoE layer fwd+bwd (fused vs eager)", "TFLOP/s", flops, timed(lambda: step(moe_fused), repeat), "eager loop",
        timed(lambda: step(moe_eager), repeat), gemm_rate,
        err if deterministic else math.nan, 3e-2, ">= 2x eager")
    if not deterministic:
        print("MoE layer: fused forward + backward is not bit-identical run to run", file=sys.stderr)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark")
        return 77
    def env(path):
        if path == "auto":
            os.environ.pop("FSDPTURBO_GROUPED_MM", None)
        else:
            os.environ["FSDPTURBO_GROUPED_MM"] = path

    repeat = 10 if args.quick else 30
    gen = torch.Generator(device=DEV).manual_seed(int.from_bytes(os.urandom(4), "little"))
    copy_bw, gemm_rate = ceilings(repeat)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; ceilings: copy {copy_bw:.0f} GB/s, "
          f"bf16 GEMM {gemm_rate:.0f} TFLOP/s")
    bench_permute(gen, copy_bw, repeat)
    bench_unpermute(gen, copy_bw, repeat)
    bench_grad_norm(gen, copy_bw, repeat)
    bench_grouped_mm(gen, gemm_rate, repeat, False, env)
    bench_grouped_mm(gen, gemm_rate, repeat, True, env)
    bench_moe_layer(gen, gemm_rate, max(repeat // 3, 3))
    head = f"{'case':<48} {'ours':>9} {'ref':>9} {'unit':<8} {'x ref':>6} {'ceil':>6} {'rel err':>9}  reference / target"
    print(head)
    print("-" * len(head))
    for r in ROWS:
        print(f"{r['case']:<48} {r['ours']:>9.1f} {r['ref']:>9.1f} {r['unit']:<8} {r['ratio']:>6.2f} "
              f"{r['ceiling_fraction']:>6.1%} {r['rel_err']:>9.2e}  {r['reference']}"
              f"{' / ' + r['target'] if r['target'] else ''}{'' if r['ok'] else '  FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_gbs=copy_bw, gemm_tflops=gemm_rate, rows=ROWS), f, indent=1)
    if FAILED:
        print(f"FAIL: results differ from the reference in {FAILED}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
