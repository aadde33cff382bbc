"""The CUDA kernels of the op library against torch references on the GPU (skipped without
one; scripts/device_check.sh runs them on an H200). Fresh random data on every run (seeded from
the clock, printed on failure), output memory poisoned with NaN before each call (the caching
allocator hands the poisoned block to the op's output), uneven and zero-token experts,
duplicate top-k ids, and both the 16-byte vector and the scalar paths.
"""
import math
import os
import time

import pytest
import torch

import fsdpturbo
import native_comm
from fsdpturbo._native import FSDPTurboError

ops = fsdpturbo.ops
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEV = "cuda"
SEED = int(os.environ.get("FSDPTURBO_TEST_SEED", time.time_ns() % 2**31))
FLOATS = [torch.bfloat16, torch.float32, torch.float16, torch.float64]


@pytest.fixture
def gen():
    print(f"FSDPTURBO_TEST_SEED={SEED}")
    return torch.Generator(device=DEV).manual_seed(SEED)


def poison(nbytes):
    """Fills a freed block of at least `nbytes` with NaN bytes so the next allocation of that
    size starts poisoned."""
    block = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=DEV)
    block.fill_(0xFF)
    del block


def routing(tokens, top_k, experts, gen, zero=(0,)):
    """Random top-k ids with duplicates allowed, uneven counts, and the experts in `zero` unused."""
    allowed = torch.tensor([e for e in range(experts) if e not in zero], device=DEV)
    pick = torch.randint(0, allowed.numel(), (tokens, top_k), device=DEV, generator=gen)
    skew = torch.randint(0, 3, (tokens, top_k), device=DEV, generator=gen) == 0  # a hot expert
    return torch.where(skew, allowed[-1], allowed[pick])


@pytest.mark.parametrize("tokens,top_k,experts,ep", [(1000, 8, 128, 8), (17, 2, 4, 4), (0, 2, 8, 2), (4096, 4, 16, 1)])
def test_route_matches_bincount_and_stable_argsort(tokens, top_k, experts, ep, gen):
    ids = routing(tokens, top_k, experts, gen, zero=(1, 3))
    poison(8 * ids.numel())
    counts, perm, splits = ops.moe_route(ids, experts, ep)
    flat = ids.reshape(-1)
    want_counts = torch.bincount(flat, minlength=experts)
    assert torch.equal(counts, want_counts)
    assert torch.equal(perm, torch.argsort(flat, stable=True))
    assert torch.equal(splits, want_counts.view(ep, -1).sum(1))
    cpu = ops.moe_route(ids.cpu(), experts, ep)
    assert all(torch.equal(a.cpu(), b) for a, b in zip((counts, perm, splits), cpu))
    again = ops.moe_route(ids, experts, ep)
    assert all(torch.equal(a, b) for a, b in zip((counts, perm, splits), again))


def test_route_rejects_out_of_range_ids_like_the_host(gen):
    ids = routing(64, 4, 8, gen)
    ids[5, 2] = 8
    ids[9, 0] = -1
    with pytest.raises(ValueError) as cpu:
        ops.moe_route(ids.cpu(), 8, 2)
    with pytest.raises(ValueError) as gpu:
        ops.moe_route(ids, 8, 2)
    assert str(gpu.value).split("fsdpturbo::moe_route: ")[-1] == str(cpu.value).split("fsdpturbo::moe_route: ")[-1]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("hidden", [2048, 13])
def test_permute_is_index_select(dtype, hidden, gen):
    tokens, top_k = 777, 4
    x = torch.randn(tokens, hidden, device=DEV, generator=gen).to(dtype)
    _, perm, _ = ops.moe_route(routing(tokens, top_k, 16, gen), 16, 4)
    poison(perm.numel() * hidden * x.element_size())
    out = ops.moe_permute(x, perm, top_k)
    assert torch.equal(out, x.index_select(0, perm // top_k))
    rows = torch.randint(0, tokens, (300,), device=DEV, generator=gen)
    assert torch.equal(ops.moe_permute(x, rows, 1), x.index_select(0, rows))


def test_permute_rejects_bad_rows_like_the_host(gen):
    x = torch.randn(10, 8, device=DEV, generator=gen)
    rows = torch.tensor([1, 2, 40, 3], device=DEV)
    with pytest.raises(ValueError) as cpu:
        ops.moe_permute(x.cpu(), rows.cpu(), 2)
    with pytest.raises(ValueError) as gpu:
        ops.moe_permute(x, rows, 2)
    assert str(cpu.value).split(": ", 1)[-1] in str(gpu.value)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("hidden,weighted", [(2048, True), (2048, False), (13, True)])
def test_unpermute_combines_like_the_host_kernel(dtype, hidden, weighted, gen):
    tokens, top_k = 555, 8
    _, perm, _ = ops.moe_route(routing(tokens, top_k, 16, gen), 16, 2)
    y = torch.randn(tokens * top_k, hidden, device=DEV, generator=gen).to(dtype)
    probs = torch.rand(tokens, top_k, device=DEV, generator=gen).to(dtype) if weighted else None
    poison(tokens * hidden * y.element_size())
    out = ops.moe_unpermute(y, perm, probs, tokens, top_k)
    # The host kernel does the same operations in the same order (f32 accumulation, k order).
    host = ops.moe_unpermute(y.cpu(), perm.cpu(), None if probs is None else probs.cpu(), tokens, top_k)
    assert torch.equal(out.cpu(), host)
    # And it is the weighted sum of torch's reference in f64 up to one rounding.
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=DEV)
    rows = y.double().index_select(0, inv).view(tokens, top_k, hidden)
    w = probs.double() if probs is not None else torch.ones(tokens, top_k, device=DEV, dtype=torch.float64)
    ref = (rows * w.unsqueeze(-1)).sum(1)
    err = (out.double() - ref).norm() / ref.norm()
    assert err < (1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-6)
    assert torch.equal(out, ops.moe_unpermute(y, perm, probs, tokens, top_k))  # run to run


def test_unpermute_rejects_a_non_permutation_like_the_host(gen):
    y = torch.randn(8, 4, device=DEV, generator=gen)
    perm = torch.tensor([0, 1, 2, 3, 4, 5, 6, 6], device=DEV)
    with pytest.raises(ValueError) as cpu:
        ops.moe_unpermute(y.cpu(), perm.cpu(), None, 4, 2)
    with pytest.raises(ValueError) as gpu:
        ops.moe_unpermute(y, perm, None, 4, 2)
    assert str(cpu.value).split(": ", 1)[-1] in str(gpu.value)


def _grouped_reference(x, counts, w, gy):
    """Per-group f64 products: y, grad_x, grad_w."""
    ys, gxs, gws = [], [], []
    start = 0
    for g, n in enumerate(counts.tolist()):
        xs, gs = x[start:start + n].double(), gy[start:start + n].double()
        ys.append(xs @ w[g].double().t())
        gxs.append(gs @ w[g].double())
        gws.append(gs.t() @ xs)
        start += n
    return torch.cat(ys), torch.cat(gxs), torch.stack(gws)


@pytest.mark.parametrize("path", ["cublas", "cublas_loop", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inf,outf", [(256, 128), (256, 8), (8, 128)], ids=["expert", "lora_a", "lora_b"])
def test_grouped_mm_forward_and_backward(path, dtype, inf, outf, gen, monkeypatch):
    """An expert's projection, and the rank-r (r = 8) factors of expert LoRA around it."""
    if path == "torch" and (dtype != torch.bfloat16 or torch.cuda.get_device_capability() < (9, 0)):
        pytest.skip("torch._grouped_mm takes bf16 on sm90+")
    monkeypatch.setenv("FSDPTURBO_GROUPED_MM", path)
    groups = 8
    counts = torch.randint(0, 300, (groups,), device=DEV, generator=gen)
    counts[[1, 5]] = 0  # empty experts
    n = int(counts.sum())
    x = torch.randn(n, inf, device=DEV, generator=gen).to(dtype)
    w = (torch.randn(groups, outf, inf, device=DEV, generator=gen) / math.sqrt(inf)).to(dtype)
    gy = torch.randn(n, outf, device=DEV, generator=gen).to(dtype)
    ry, rgx, rgw = _grouped_reference(x, counts, w, gy)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    poison(n * outf * x.element_size())
    y = ops.grouped_mm(x, counts, w)
    poison(n * inf * x.element_size())
    gx = ops.grouped_mm_grad_input(gy, counts, w)
    poison(w.numel() * x.element_size())
    gw = ops.grouped_mm_grad_weight(gy, x, counts)
    for got, ref in ((y, ry), (gx, rgx), (gw, rgw)):
        assert torch.isfinite(got).all()
        assert (got.double() - ref).norm() / ref.norm() < tol
    assert torch.equal(gw[1], torch.zeros_like(gw[1])) and torch.equal(gw[5], torch.zeros_like(gw[5]))
    # Autograd through the op.
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ops.grouped_mm(xr, counts, wr).backward(gy)
    assert (xr.grad.double() - rgx).norm() / rgx.norm() < tol
    assert (wr.grad.double() - rgw).norm() / rgw.norm() < tol


def _tensors(gen, dtypes, sizes):
    return [torch.randn(s, device=DEV, generator=gen).to(d) for d, s in zip(dtypes, sizes)]


@pytest.mark.parametrize("p", [1.0, 2.0, 3.5, math.inf])
def test_power_sum_matches_foreach_norm(p, gen):
    sizes = [65536 * 3 + 5, 1, 4097, 0, 262144, 333]
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float32]
    ts = _tensors(gen, dtypes, sizes)
    ts.append(torch.randn(64, 33, device=DEV, generator=gen)[:, 1:])  # non-contiguous
    got = ops.power_sum(ts, p, True)
    norms = torch.stack([torch._foreach_norm([t.double()], p)[0] for t in ts])
    want = norms.max() if p == math.inf else norms.pow(p).sum()
    assert got.device.type == "cuda"
    assert abs(float(got) - float(want)) <= 1e-9 * abs(float(want))
    assert torch.equal(got, ops.power_sum(ts, p, True))  # deterministic
    host = ops.power_sum([t.cpu() for t in ts], p, True)
    assert abs(float(got) - float(host)) <= 1e-10 * abs(float(host))  # f64 sums in another order


def test_power_sum_propagates_nan_for_the_max_norm(gen):
    ts = _tensors(gen, [torch.float32, torch.bfloat16], [1000, 70000])
    ts[1][65540] = float("nan")
    assert math.isnan(float(ops.power_sum(ts, math.inf, True)))
    ts[1][65540] = float("inf")
    assert float(ops.power_sum(ts, math.inf, True)) == math.inf


@pytest.mark.parametrize("coef", [0.37, 1e-3])
def test_foreach_scale_matches_the_host_kernel(coef, gen):
    ts = _tensors(gen, FLOATS + [torch.bfloat16], [70001, 5, 65536, 3, 1])
    ts.append(torch.randn(32, 9, device=DEV, generator=gen)[:, ::2])
    host = [t.cpu() for t in ts]
    ops.foreach_scale_(ts, coef)
    ops.foreach_scale_(host, coef)
    for a, b in zip(ts, host):
        assert torch.equal(a.cpu(), b)


def test_clip_grad_norm_on_cuda_matches_torch(gen):
    params = [torch.nn.Parameter(torch.zeros(s, device=DEV)) for s in (1000, 33, 70000)]
    for prm in params:
        prm.grad = torch.randn(prm.shape, device=DEV, generator=gen)
    ref = [torch.nn.Parameter(prm.detach().clone()) for prm in params]
    for r, prm in zip(ref, params):
        r.grad = prm.grad.clone()
    want = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    got = fsdpturbo.clip_grad_norm_(params, 0.5)
    assert abs(float(got) - float(want)) <= 1e-5 * float(want)
    for prm, r in zip(params, ref):
        torch.testing.assert_close(prm.grad, r.grad, rtol=1e-5, atol=1e-7)


def test_one_rank_nccl_all_reduce_through_our_loader():
    uid = native_comm.nccl_unique_id()
    c = native_comm.nccl_comm(uid, 1, 0, torch.cuda.current_device())
    try:
        t = torch.arange(1024, dtype=torch.float32, device=DEV)
        c.all_reduce(t, 0)
        torch.cuda.synchronize()
        assert torch.equal(t, torch.arange(1024, dtype=torch.float32, device=DEV))
        send = torch.randn(6, 4, device=DEV)
        recv = torch.full_like(send, float("nan"))
        c.all_to_all_v(send, recv, [6], [6])
        torch.cuda.synchronize()
        assert torch.equal(recv, send)
    finally:
        c.free()


def test_an_nccl_communicator_a_peer_never_joins_fails_within_its_deadline():
    """The real NCCL's nonblocking join (tests/nccl_deadline.rs checks the same over doubles):
    rank 1 of 2 never comes, so rank 0's join stays in progress until the deadline aborts it."""
    start = time.monotonic()
    with pytest.raises(FSDPTurboError, match=r"did not finish within 3 s on rank 0 of 2"):
        native_comm.nccl_comm(native_comm.nccl_unique_id(), 2, 0, torch.cuda.current_device(), timeout_ms=3000)
    assert time.monotonic() - start < 60


def test_nccl_comm_from_a_gloo_group_id_broadcast(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        c = native_comm.nccl_comm_for_group()
        t = torch.full((7,), 3.0, device=DEV, dtype=torch.bfloat16)
        c.all_reduce(t, 1)  # MAX
        torch.cuda.synchronize()
        assert torch.equal(t, torch.full_like(t, 3.0))
        c.free()
    finally:
        dist.destroy_process_group()
