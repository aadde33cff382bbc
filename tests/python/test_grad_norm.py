"""The placement-aware gradient norm (docs/design.md §4.2) against torch itself.

Multi-rank tests build one small model whose parameters sit on every layout FSDPTurbo produces,
on gloo ranks with the seed's meshes (fsdpturbo.ParallelState):
  (a) FSDP2 `fully_shard` over the dp mesh (`embed`, `dense`, `tiny`; `tiny.bias` has 3 rows, so
      with dp = 4 one dp rank holds an empty shard),
  (b) a `Shard(0)` DTensor on the ep mesh (`ep_w`),
  (c) EP `Shard(0)` then FSDP2 over efsdp, the seed's expert layout: mesh (efsdp, ep), placements
      (Shard(1), Shard(0)) and, for the 1-D bias, (_StridedShard(0), Shard(0)) (`experts.*`),
  (d) plain replicated tensors (`router.weight`, `plain_b`),
  (e) (Shard(0) on dp, Replicate on cp) on a second (dp, cp) DeviceMesh whose process groups are
      new objects with the same ranks as the data mesh's (`cp_w`),
  (f) a Replicate parameter whose gradient is Partial (`rep_w`).
Every rank draws the same FULL gradients (seeded) and places its own piece; the oracle is
`torch.nn.utils.clip_grad_norm_` on an unsharded copy with the same full gradients, and torch's
DTensor (`distribute_tensor(..., src_data_rank=None)`, `full_tensor()`) for the slices.
"""
import logging
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdpturbo
import fsdpturbo.norm as fnorm
from dist_util import run_ranks

pytestmark = pytest.mark.parity  # also run on the other instruction sets (ctest parity_*)

P_VALUES = (1.0, 2.0, 3.5, math.inf)
# name: (world, cp, ep); efsdp = dp / ep (the seed's formula)
TOPOLOGIES = {"w4_ep2_efsdp2": (4, 1, 2), "w4_cp2_ep2": (4, 2, 2), "w8_cp2_ep2_efsdp2": (8, 2, 2)}
EXPERTS = 4


U32 = 2.0 ** -24  # float32's unit roundoff


def norm_rtol(grads, p):
    """How far, relatively, two correct float32 computations of one p-norm of the float32
    gradients `grads` (tensors, or a dict of them) may differ, in any order on any IEEE machine:
    a float32 sum of n non-negative terms (the p-th powers) in any order is within (n − 1)·u of
    the exact sum, as there is no cancellation; each power and the root add a rounding, and the
    root scales the sum's relative error by 1/p. Each result is then within ((n + 1)/min(p, 1) +
    1)·u of the exact norm, and two of them twice that. For p = ∞ (a maximum, exact) the
    final rounding alone."""
    if p == math.inf:
        return 2 * U32
    n = sum(g.numel() for g in (grads.values() if isinstance(grads, dict) else grads) if g is not None)
    return 2 * ((n + 1) / min(p, 1.0) + 1) * U32


# A clipped gradient is the gradient times the coefficient rounded to float32: with the
# coefficients' own difference, two roundings more.
CLIP_ROUNDINGS = 3 * U32


def _rel(a, b):
    a, b = float(a), float(b)
    return abs(a - b) / abs(b) if b else abs(a)


# ---------------------------------------------------------------------------------------------
# The model and its gradients (every function below runs on each rank).

class _Toy(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.embed = nn.Embedding(10, 6, dtype=dtype)
        self.dense = nn.Linear(6, 5, dtype=dtype)
        self.tiny = nn.Linear(6, 3, dtype=dtype)
        self.router = nn.Linear(6, EXPERTS, bias=False, dtype=dtype)
        self.plain_b = nn.Parameter(torch.zeros(5, dtype=dtype))
        self.ep_w = nn.Parameter(torch.zeros(EXPERTS, 3, 6, dtype=dtype))
        self.experts = nn.Module()
        self.experts.w = nn.Parameter(torch.zeros(EXPERTS, 6, 5, dtype=dtype))
        self.experts.b = nn.Parameter(torch.zeros(EXPERTS * 3, dtype=dtype))
        self.cp_w = nn.Parameter(torch.zeros(7, 3, dtype=dtype))
        self.rep_w = nn.Parameter(torch.zeros(4, 2, dtype=dtype))


def _build(world, cp, ep, dtype=torch.float32, with_partial=True):
    """The model on its meshes; returns (state, model, cp_mesh_2d)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    state = fsdpturbo.ParallelState(world, cp_size=cp, ep_size=ep).init_device_meshes("cpu")
    dp_mesh, ep_mesh, efsdp_mesh = state.sub_mesh("dp"), state.sub_mesh("ep"), state.sub_mesh("efsdp")
    # (e) on a separate (dp, cp) mesh: new process-group objects over the same ranks as data_mesh's.
    cp_mesh = init_device_mesh("cpu", state.mesh_shape("data"), mesh_dim_names=("dp2", "cp2"))
    model = _Toy(dtype)
    if not with_partial:
        del model.rep_w
    model.ep_w = nn.Parameter(distribute_tensor(model.ep_w.detach(), ep_mesh, [Shard(0)]))
    for name in ("w", "b"):
        setattr(model.experts, name,
                nn.Parameter(distribute_tensor(getattr(model.experts, name).detach(), ep_mesh, [Shard(0)])))
    if state.efsdp_size > 1:  # the seed applies EFSDP only then
        fully_shard(model.experts, mesh=efsdp_mesh,
                    shard_placement_fn=lambda p: Shard(1) if p.dim() > 1 else Shard(0))
    model.cp_w = nn.Parameter(distribute_tensor(model.cp_w.detach(), cp_mesh, [Shard(0), Replicate()]))
    ignored = {model.router.weight, model.plain_b, model.ep_w, model.cp_w}
    if state.efsdp_size == 1:  # experts stay EP-only and outside the outer FSDP2, as in the seed
        ignored |= {model.experts.w, model.experts.b}
    if with_partial:
        model.rep_w = nn.Parameter(distribute_tensor(model.rep_w.detach(), dp_mesh, [Replicate()]))
        ignored.add(model.rep_w)
    fully_shard(model, mesh=dp_mesh, ignored_params=ignored)
    return state, model


def _full_grads(model, seed=1234, dtype=None):
    """The same full gradients on every rank: name -> tensor of the parameter's global shape;
    each parameter gets its own scale so that different ones dominate different norms."""
    gen = torch.Generator().manual_seed(seed)
    fulls = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        g = torch.randn(tuple(p.shape), generator=gen) * (0.5 + (i % 5))
        fulls[name] = g.to(dtype or p.dtype)
    return fulls


def _local_piece(p, full):
    """This rank's piece of `full` for parameter p (torch's DTensor slicing)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(p, DTensor):
        return full.clone()
    return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local().clone()


def _set_grads(model, fulls, drop_empty=True):
    """Places each rank's piece of the full gradients; a rank whose shard is empty keeps None.
    `rep_w` gets a Partial gradient: dp coordinate 0 holds the full values, the others zeros."""
    from torch.distributed.tensor import DTensor, Partial

    for name, p in model.named_parameters():
        if name == "rep_w":
            mesh = p.device_mesh
            local = fulls[name].clone() if mesh.get_local_rank() == 0 else torch.zeros_like(fulls[name])
            p.grad = DTensor.from_local(local, mesh, [Partial()])
            continue
        local = _local_piece(p, fulls[name])
        if drop_empty and local.numel() == 0:
            p.grad = None
            continue
        if isinstance(p, DTensor):
            p.grad = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        else:
            p.grad = local


def _reference(fulls, max_norm, p):
    """torch.nn.utils.clip_grad_norm_ on an unsharded copy: (total, clipped full grads)."""
    params = {}
    for name, g in fulls.items():
        params[name] = nn.Parameter(torch.zeros_like(g))
        params[name].grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm, norm_type=p, foreach=True)
    return total, {name: q.grad for name, q in params.items()}


def _local_grad(model, name):
    from torch.distributed.tensor import DTensor

    p = dict(model.named_parameters())[name]
    if p.grad is None:
        return None
    if name == "rep_w":
        return p.grad.full_tensor()  # Partial: the reduced value
    return p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad


def _op_name(op):
    return "MAX" if op == dist.ReduceOp.MAX else "SUM" if op == dist.ReduceOp.SUM else repr(op)


class _CollectiveLog:
    """Records every dist.all_reduce the norm issues: (op, group ranks)."""

    def __init__(self):
        self.calls = []
        self._orig = dist.all_reduce

    def __enter__(self):
        def spy(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            self.calls.append((_op_name(op), tuple(dist.get_process_group_ranks(group))))
            return self._orig(tensor, op=op, group=group, async_op=async_op)
        dist.all_reduce = spy
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._orig


def _same_on_all_ranks(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    assert all(v == out[0] for v in out), out


def _expected_sets(state):
    """The number of scalar all-reduces the model needs: {dp} (FSDP2 and cp_w: the two meshes' dp
    groups coincide), {ep} (ep_w; experts too when efsdp = 1), {efsdp, ep} (2 dims, only when
    efsdp > 1); plain, Replicate and Partial-reduced gradients need none. With efsdp = 1 and
    cp > 1 (world 4, cp 2, ep 2) the ep group IS the dp group ({1, 3} on rank 3), so {dp} and
    {ep} are one set and one all-reduce."""
    rank = dist.get_rank()
    same = state.group_ranks("data", "dp", rank) == state.group_ranks("expert", "ep", rank)
    return (1 if same else 2) + (2 if state.efsdp_size > 1 else 0)


# ---------------------------------------------------------------------------------------------
# (1) The norm and the clipped gradients equal torch's, for every p and both kernels.

def _matches_torch(rank, world, cp, ep):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    state, model = _build(world, cp, ep)
    fulls = _full_grads(model)
    params = dict(model.named_parameters())
    # The layouts are the ones the test claims to cover.
    assert params["dense.weight"].placements[0].is_shard(0)
    assert params["ep_w"].device_mesh.mesh_dim_names == ("ep",)
    if state.efsdp_size > 1:
        assert params["experts.w"].device_mesh.mesh_dim_names == ("efsdp", "ep")
        assert isinstance(params["experts.b"].placements[0], _StridedShard)
    assert not isinstance(params["router.weight"], DTensor)
    assert params["cp_w"].placements[1].is_replicate()
    empty_here = params["tiny.bias"].to_local().numel() == 0
    assert empty_here == (state.dp_size == 4 and state.sub_mesh("dp").get_local_rank() == 3)

    for force_torch in (False, True):
        fnorm._FORCE_TORCH_KERNELS = force_torch
        for p in P_VALUES:
            if force_torch and p not in (2.0, math.inf):
                continue
            ref_total, _ = _reference(fulls, math.inf, p)
            for max_norm in (0.3 * float(ref_total), 10 * float(ref_total)):
                ref_total, ref_clipped = _reference(fulls, max_norm, p)
                _set_grads(model, fulls)
                assert (params["tiny.bias"].grad is None) == empty_here
                before = {n: _local_grad(model, n) for n in params}
                before = {n: None if g is None else g.clone() for n, g in before.items()}
                with _CollectiveLog() as log:
                    total = fsdpturbo.clip_grad_norm_(model, max_norm, norm_type=p)
                assert total.dim() == 0 and total.dtype == torch.float32
                assert _rel(total, ref_total) <= norm_rtol(fulls, p), (p, force_torch, float(total), float(ref_total))
                assert len(log.calls) == _expected_sets(state), log.calls
                assert all(op == ("MAX" if p == math.inf else "SUM") for op, _ in log.calls), log.calls
                _same_on_all_ranks([op for op, _ in log.calls])
                clipped = max_norm < float(ref_total)
                for name, p_ in params.items():
                    got = _local_grad(model, name)
                    if got is None:
                        continue
                    if name == "rep_w":
                        want = ref_clipped[name]
                    else:
                        want = _local_piece(p_, ref_clipped[name])
                    if clipped:
                        torch.testing.assert_close(got, want, rtol=norm_rtol(fulls, p) + CLIP_ROUNDINGS, atol=0,
                                                   msg=f"{name} p={p}")
                    else:  # not clipped: untouched, bit for bit
                        assert torch.equal(got, before[name]), name
    fnorm._FORCE_TORCH_KERNELS = False

    # get_total_norm on the module, on the parameters and on the gradients themselves.
    _set_grads(model, fulls)
    ref_total, _ = _reference(fulls, math.inf, 2.0)
    grads = [q.grad for q in model.parameters() if q.grad is not None]
    if empty_here:
        # Gradients passed directly define the collectives, so every rank must pass the same
        # list: give the empty-shard rank an empty DTensor gradient rather than None.
        grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in model.parameters()]
    for arg in (model, list(model.parameters()), grads):
        assert _rel(fsdpturbo.get_total_norm(arg), ref_total) <= norm_rtol(fulls, 2.0)


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_norm_and_clipped_grads_equal_torch(topology):
    run_ranks(_matches_torch, TOPOLOGIES[topology][0], *TOPOLOGIES[topology][1:])


# ---------------------------------------------------------------------------------------------
# (2) A rank without any gradient completes, issues the same collectives, and every rank's
#     norm is torch's norm of what its groups hold (DTensor full_tensor() with zeros there).

def _rank_without_grads(rank, world, cp, ep):
    from torch.distributed.tensor import DTensor

    state, model = _build(world, cp, ep, with_partial=False)
    fulls = _full_grads(model)
    empty_rank = world - 1
    with _CollectiveLog() as full_log:
        _set_grads(model, fulls, drop_empty=False)
        full_total = fsdpturbo.get_total_norm(model)
    for p in (2.0, math.inf):
        _set_grads(model, fulls, drop_empty=False)
        views = []
        for name, q in model.named_parameters():
            if rank == empty_rank:
                q.grad = None
            local = _local_piece(q, fulls[name])
            if rank == empty_rank:
                local = torch.zeros_like(local)
            if isinstance(q, DTensor):
                views.append(DTensor.from_local(local, q.device_mesh, q.placements, shape=q.shape,
                                                stride=q.stride()).full_tensor())
            else:
                views.append(local)
        expected = torch.nn.utils.get_total_norm(views, p)
        before = [None if q.grad is None else q.grad.to_local().clone() if isinstance(q.grad, DTensor)
                  else q.grad.clone() for q in model.parameters()]
        max_norm = 0.25 * float(expected)
        with _CollectiveLog() as log:
            total = fsdpturbo.clip_grad_norm_(model, max_norm, norm_type=p)
        assert len(log.calls) == _expected_sets(state) == len(full_log.calls)
        assert [g for _, g in log.calls] == [g for _, g in full_log.calls]
        _same_on_all_ranks(len(log.calls))
        assert _rel(total, expected) <= norm_rtol(views, p), (p, float(total), float(expected))
        if rank == empty_rank:
            assert float(total) < float(full_total)
            assert all(q.grad is None for q in model.parameters())
        coef = max_norm / (float(total) + 1e-6)
        for q, old in zip(model.parameters(), before):
            if old is not None:
                got = q.grad.to_local() if isinstance(q.grad, DTensor) else q.grad
                torch.testing.assert_close(got, old * coef, rtol=CLIP_ROUNDINGS, atol=0)


@pytest.mark.parametrize("topology", ["w4_ep2_efsdp2", "w8_cp2_ep2_efsdp2"])
def test_rank_without_gradients_does_not_hang(topology):
    run_ranks(_rank_without_grads, TOPOLOGIES[topology][0], *TOPOLOGIES[topology][1:], timeout=150)


# ---------------------------------------------------------------------------------------------
# (3) nan / inf: returned like torch, gradients untouched; error_if_nonfinite raises everywhere.

def _snapshot(model):
    from torch.distributed.tensor import DTensor

    return [None if q.grad is None else
            (q.grad.to_local() if isinstance(q.grad, DTensor) else q.grad).clone() for q in model.parameters()]


def _untouched(model, before):
    for now, old in zip(_snapshot(model), before):
        if old is not None:
            torch.testing.assert_close(now, old, rtol=0, atol=0, equal_nan=True)


def _nonfinite(rank, world, cp, ep):
    state, model = _build(world, cp, ep)
    for bad in (math.nan, math.inf):
        # A single bad element in one shard (set {ep}, {efsdp, ep}, {dp}) or in a plain tensor.
        for where, index in (("ep_w", (3, 2, 5)), ("experts.w", (2, 5, 1)), ("dense.weight", (4, 0)),
                             ("router.weight", (1, 1))):
            fulls = _full_grads(model)
            fulls[where][index] = bad
            for p in (2.0, math.inf):
                for force_torch in (False, True):
                    fnorm._FORCE_TORCH_KERNELS = force_torch
                    ref = torch.nn.utils.get_total_norm(list(fulls.values()), p)
                    _set_grads(model, fulls)
                    before = _snapshot(model)
                    total = fsdpturbo.clip_grad_norm_(model, 0.01, norm_type=p)
                    assert math.isnan(total) == math.isnan(ref) and math.isinf(total) == math.isinf(ref), \
                        (bad, where, p, float(total), float(ref))
                    _untouched(model, before)
                    with pytest.raises(RuntimeError, match=r"The total norm of order .* is non-finite"):
                        fsdpturbo.clip_grad_norm_(model, 0.01, norm_type=p, error_if_nonfinite=True)
                    _untouched(model, before)
                    with pytest.raises(RuntimeError, match=r"non-finite"):
                        fsdpturbo.get_total_norm(model, p, error_if_nonfinite=True)
    fnorm._FORCE_TORCH_KERNELS = False


def test_nonfinite_gradients_are_returned_and_left_untouched():
    run_ranks(_nonfinite, *TOPOLOGIES["w4_ep2_efsdp2"])


# ---------------------------------------------------------------------------------------------
# (4) bf16 gradients: exact (f64 accumulation) against the f64 norm of the same bf16 values,
#     and within bf16 tolerance of torch's own bf16 clip.

def _bf16(rank, world, cp, ep):
    state, model = _build(world, cp, ep, dtype=torch.bfloat16)
    fulls = _full_grads(model)
    assert all(g.dtype == torch.bfloat16 for g in fulls.values())
    for p in P_VALUES:
        exact = torch.nn.utils.get_total_norm([g.double() for g in fulls.values()], p)
        torch_total, torch_clipped = _reference(fulls, 0.5 * float(exact), p)
        _set_grads(model, fulls)
        total = fsdpturbo.clip_grad_norm_(model, 0.5 * float(exact), norm_type=p)
        assert total.dtype == torch.float32
        assert _rel(total, exact) <= 1e-6, (p, float(total), float(exact))
        assert _rel(total, torch_total) <= 2 ** -7, (p, float(total), float(torch_total))
        coef = 0.5 * float(exact) / (float(total) + 1e-6)
        for name, q in model.named_parameters():
            got = _local_grad(model, name)
            if got is None:
                continue
            want = torch_clipped[name] if name == "rep_w" else _local_piece(q, torch_clipped[name])
            torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-5)
            own = fulls[name] if name == "rep_w" else _local_piece(q, fulls[name])
            torch.testing.assert_close(got.float(), (own.float() * coef).bfloat16().float(), rtol=2 ** -7, atol=0)


def test_bf16_gradients():
    run_ranks(_bf16, *TOPOLOGIES["w4_ep2_efsdp2"])


# ---------------------------------------------------------------------------------------------
# (5) The seed's algorithm (docs/seed.md) over-counts replicas; ours does not.

def _seed_total_norm(params, p, state):
    """LlamaFactory's FSDPTurbo grad norm, line for line (§7.1 steps 3-8): non-EP summed over dp
    then cp, EP over efsdp, ep, expert_cp."""
    from torch.distributed.tensor import DTensor

    cp_on = state.cp_size > 1
    dp_group = state.sub_mesh("dp").get_group()
    cp_group = state.sub_mesh("cp").get_group() if cp_on else None
    ep_group = state.sub_mesh("ep").get_group()
    efsdp_group = state.sub_mesh("efsdp").get_group()
    expert_cp_group = state.sub_mesh("expert_cp").get_group() if cp_on else None
    ep_side, non_ep = [], []
    for q in params:
        if q.grad is None:
            continue
        g = q.grad
        if isinstance(g, DTensor) and set(g.device_mesh.mesh_dim_names or ()) & {"ep", "efsdp"}:
            ep_side.append(g)
        else:
            non_ep.append(g)

    def local_sum(grads):
        s = torch.zeros((), dtype=torch.float32)
        for g in grads:
            local = g.to_local() if isinstance(g, DTensor) else g
            s += torch.norm(local.detach().to(torch.float32), p) ** p
        return s

    total = torch.zeros((), dtype=torch.float32)
    if non_ep:
        s = local_sum(non_ep)
        for group in (dp_group, cp_group):
            if group is not None:
                dist.all_reduce(s, op=dist.ReduceOp.SUM, group=group)
        total += s
    if ep_side:
        s = local_sum(ep_side)
        for group in (efsdp_group, ep_group, expert_cp_group):
            if group is not None:
                dist.all_reduce(s, op=dist.ReduceOp.SUM, group=group)
        total += s
    return total ** (1.0 / p)


def _seed_overcounts(rank, world, cp, ep):
    from torch.distributed.tensor import DTensor

    state, model = _build(world, cp, ep, with_partial=False)
    fulls = _full_grads(model)
    _set_grads(model, fulls)
    params = dict(model.named_parameters())
    cases = {"a_fsdp2_dp": ["embed.weight", "dense.weight", "dense.bias", "tiny.weight", "tiny.bias"],
             "b_ep": ["ep_w"], "c_efsdp_ep": ["experts.w", "experts.b"],
             "d_plain": ["router.weight", "plain_b"], "e_cp_replicated": ["cp_w"]}
    for case, names in cases.items():
        ref = torch.nn.utils.get_total_norm([fulls[n] for n in names], 2.0)
        ours = fsdpturbo.get_total_norm([params[n] for n in names], 2.0)
        seed = _seed_total_norm([params[n] for n in names], 2.0, state)
        assert _rel(ours, ref) <= norm_rtol([fulls[n] for n in names], 2.0), (case, float(ours), float(ref))
        # The seed effectively sums every rank's local norm: each gradient is counted once per
        # replica, i.e. world / (product of the sizes of the dims it is sharded over) times.
        q = params[names[0]]
        shards = 1
        if isinstance(q, DTensor):
            for i, pl in enumerate(q.placements):
                if not pl.is_replicate():
                    shards *= q.device_mesh.size(i)
        replicas = world // shards
        assert _rel(seed, math.sqrt(replicas) * float(ref)) <= 1e-5, (case, replicas, float(seed), float(ref))
        if case == "e_cp_replicated":
            assert replicas == cp
            if cp > 1:
                assert float(seed) > 1.4 * float(ref)  # counted cp = 2 times: √2 × the norm
    # The whole model: ours is torch's; the seed's is larger whenever anything is replicated.
    ref_all = torch.nn.utils.get_total_norm(list(fulls.values()), 2.0)
    assert _rel(fsdpturbo.get_total_norm(model), ref_all) <= norm_rtol(fulls, 2.0)
    assert float(_seed_total_norm(list(model.parameters()), 2.0, state)) > 1.1 * float(ref_all)


@pytest.mark.parametrize("topology", ["w4_ep2_efsdp2", "w8_cp2_ep2_efsdp2"])
def test_seed_algorithm_overcounts_replicas_and_ours_does_not(topology):
    run_ranks(_seed_overcounts, TOPOLOGIES[topology][0], *TOPOLOGIES[topology][1:])


# ---------------------------------------------------------------------------------------------
# (6) Warm-up, and a gradient whose placement contradicts its parameter.

def _lifecycle(rank, world, cp, ep):
    from torch.distributed.tensor import DTensor, Replicate

    state, model = _build(world, cp, ep, with_partial=False)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("fsdpturbo.norm")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    fulls = _full_grads(model)
    _set_grads(model, fulls)  # grads the warm-up resets
    with _CollectiveLog() as log:
        fsdpturbo.warmup_grad_norm(model)
    logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["Warming up FSDPTurbo mixed-mesh grad norm computation...",
                                                 "FSDPTurbo mixed-mesh grad norm warmup completed."]
    assert len(log.calls) == _expected_sets(state)
    assert all(q.grad is None for q in model.parameters())

    # A Shard(0) parameter with a Replicate gradient: the reduction set would differ.
    _set_grads(model, fulls)
    w = model.dense.weight
    w.grad = DTensor.from_local(fulls["dense.weight"].clone(), w.device_mesh, [Replicate()])
    with pytest.raises(ValueError, match=r"dense\.weight: the gradient is sharded over the groups \[\]"):
        fsdpturbo.clip_grad_norm_(model, 1.0)


def test_warmup_and_mismatched_gradient_placement():
    run_ranks(_lifecycle, *TOPOLOGIES["w4_ep2_efsdp2"])


# ---------------------------------------------------------------------------------------------
# Single process: plain tensors need no collective, so torch is the oracle directly.

def _plain_params(dtypes=(torch.float32, torch.float64, torch.bfloat16, torch.float16)):
    gen = torch.Generator().manual_seed(7)
    params = []
    for i, dtype in enumerate(dtypes):
        q = nn.Parameter(torch.zeros(6, 5, dtype=dtype))
        q.grad = (torch.randn(6, 5, generator=gen) * (i + 1)).to(dtype)
        params.append(q)
    q = nn.Parameter(torch.zeros(5, 6))
    q.grad = torch.randn(6, 5, generator=gen).t()  # non-contiguous
    params.append(q)
    params.append(nn.Parameter(torch.zeros(0, 3)))
    params[-1].grad = torch.zeros(0, 3)
    params.append(nn.Parameter(torch.zeros(3)))  # no gradient
    return params


@pytest.mark.parametrize("force_torch", [False, True])
@pytest.mark.parametrize("p", [0.5, 1.0, 2.0, 3.5, math.inf])
def test_single_process_equals_torch(p, force_torch, monkeypatch):
    monkeypatch.setattr(fnorm, "_FORCE_TORCH_KERNELS", force_torch)
    dtypes = (torch.float32, torch.float32)
    ours, theirs = _plain_params(dtypes), _plain_params(dtypes)
    # torch's _foreach_norm rejects an empty tensor for p = inf (no identity); ours gives it 0.
    ref = torch.nn.utils.clip_grad_norm_([q for q in theirs if q.grad is None or q.grad.numel()], 0.1,
                                         norm_type=p)
    total = fsdpturbo.clip_grad_norm_(ours, 0.1, norm_type=p)
    assert total.dim() == 0 and total.dtype == torch.float32
    rtol = norm_rtol([q.grad for q in theirs], p)
    assert _rel(total, ref) <= rtol
    for a, b in zip(ours, theirs):
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=rtol + CLIP_ROUNDINGS, atol=0)
            assert a.grad.stride() == b.grad.stride()  # scaled in place, layout kept


def test_single_process_mixed_dtypes_module_and_grads():
    params = _plain_params()
    exact = torch.nn.utils.get_total_norm([q.grad.double() for q in params if q.grad is not None], 2.0)
    total = fsdpturbo.get_total_norm(params)
    assert total.dtype == torch.float64  # a float64 gradient is present
    assert _rel(total, exact) <= 1e-12
    assert _rel(fsdpturbo.get_total_norm([q.grad for q in params if q.grad is not None]), exact) <= 1e-12
    module = nn.ParameterList(params)
    assert _rel(fsdpturbo.get_total_norm(module), exact) <= 1e-12
    grads = {i: q.grad.clone() for i, q in enumerate(params) if q.grad is not None}
    fsdpturbo.clip_grad_norm_(module, float(exact) / 4)
    coef = (float(exact) / 4) / (float(exact) + 1e-6)
    for i, g in grads.items():
        rtol = 1e-6 if g.dtype in (torch.float32, torch.float64) else 2 ** -7
        torch.testing.assert_close(params[i].grad, (g.double() * coef).to(g.dtype), rtol=rtol, atol=0)


def test_single_process_edge_cases():
    for bad in (0, 0.0, -1.0, math.nan, -math.inf):
        with pytest.raises(ValueError, match=r"norm_type must be a finite p > 0"):
            fsdpturbo.get_total_norm([torch.ones(3)], bad)
    with pytest.raises(ValueError, match=r"p = 0 counts non-zero entries"):
        fsdpturbo.clip_grad_norm_([nn.Parameter(torch.ones(3))], 1.0, norm_type=0)
    with pytest.raises(ValueError, match=r"max_norm must be a number >= 0"):
        fsdpturbo.clip_grad_norm_([nn.Parameter(torch.ones(3))], -1.0)
    # No parameters, or none with a gradient: 0.
    assert float(fsdpturbo.clip_grad_norm_([], 1.0)) == 0.0
    q = nn.Parameter(torch.ones(3))
    assert float(fsdpturbo.clip_grad_norm_([q], 1.0)) == 0.0 and q.grad is None
    # A single tensor is a gradient for get_total_norm and a parameter for clip_grad_norm_.
    assert float(fsdpturbo.get_total_norm(torch.tensor([3.0, 4.0]))) == 5.0
    q.grad = torch.tensor([3.0, 4.0, 0.0])
    assert float(fsdpturbo.get_total_norm(q)) == 5.0
    assert float(fsdpturbo.clip_grad_norm_(q, 1.0)) == 5.0
    torch.testing.assert_close(q.grad, torch.tensor([0.6, 0.8, 0.0]), rtol=1e-6, atol=0)
    # max_norm = inf never scales; frozen parameters without gradient are skipped.
    q.grad = torch.tensor([3.0, 4.0, 0.0])
    frozen = nn.Parameter(torch.ones(2), requires_grad=False)
    assert float(fsdpturbo.clip_grad_norm_([q, frozen], math.inf)) == 5.0
    assert torch.equal(q.grad, torch.tensor([3.0, 4.0, 0.0]))
    # Non-finite, single process: untouched, or an error in torch's words.
    q.grad = torch.tensor([3.0, math.inf, 0.0])
    assert math.isinf(fsdpturbo.clip_grad_norm_(q, 1.0)) and q.grad[0] == 3.0
    with pytest.raises(RuntimeError, match=r"The total norm of order 2\.0 for gradients from `parameters` "
                                           r"is non-finite \(inf\), so it cannot be clipped"):
        fsdpturbo.clip_grad_norm_(q, 1.0, error_if_nonfinite=True)
    with pytest.raises(TypeError, match=r"parameters\[0\]: expected a tensor"):
        fsdpturbo.get_total_norm([1.0])


def test_single_process_warmup_resets_gradients():
    model = nn.Linear(4, 3)
    model.weight.grad = torch.ones(3, 4)
    fsdpturbo.warmup_grad_norm(model)
    assert model.weight.grad is None and model.bias.grad is None


def test_reduction_sets_come_from_the_core():
    # The grouping is fsdpturbo_norm_plan's (the example of tests/c/test_norm.c): sets in
    # first-seen order, each with its ids sorted, the empty set for plain and replicated entries.
    assert fnorm._norm_plan([(2, 1), (), (1,), ()]) == ([0, 1, 2, 1], [[1, 2], [], [1]])
    assert fnorm._norm_plan([(3, 0), (0, 3), (5,), (0, 3)]) == ([0, 0, 1, 0], [[0, 3], [5]])
    assert fnorm._norm_plan([]) == ([], [])
    with pytest.raises(fsdpturbo.FSDPTurboValueError, match=r"gradient 1: .*appears twice"):
        fnorm._norm_plan([(), (4, 4)])
