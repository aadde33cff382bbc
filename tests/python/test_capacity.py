"""The capacity-bounded dispatch (`dist_config.capacity_factor` / `expert_capacity`) on gloo
ranks: with enough capacity it equals the dropless dispatch (fused: bitwise) and the block run in
one process (eager: within the error model of fsdpturbo.parity; test_conformance also runs both
modes on its nasty routings), with too little it drops exactly the slots a plain-Python count says (against
a Hugging Face block run in one process with those slots' weights zeroed), `fail` raises on every
rank with the layer, the expert and the counts, and forward and backward reach no host sync."""
import collections

import pytest
import torch
import torch.distributed as dist

import fsdpturbo
from dist_util import run_ranks
from fsdpturbo.moe.dispatch import Capacity
from host_sync import HostSync, no_host_sync
from blocks import ROUTES, TOKENS_PER_RANK, block_data, ep_block, ep_step, moe_block, one_process_gates

pytestmark = pytest.mark.parity  # also run on the other instruction sets (ctest parity_*)



def _enough_capacity_rank_fn(rank, world, ep):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))["ep"]
    x_all, cotangent = block_data(world, torch.float32)
    rows = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    inputs = [(x_all[r * TOKENS_PER_RANK:(r + 1) * TOKENS_PER_RANK], cotangent[r * TOKENS_PER_RANK:(r + 1) * TOKENS_PER_RANK]) for r in range(world)]
    for route_name, route in ROUTES.items():
        routes = [None if route is None else route(world * TOKENS_PER_RANK)[r * TOKENS_PER_RANK:(r + 1) * TOKENS_PER_RANK] for r in range(world)]
        local, every = one_process_gates(torch.float32, inputs, routes, rank)
        # Every slot fits: C = all slots of a rank (expert_capacity), or a factor that gives it.
        for capacity in (Capacity(tokens=2 * TOKENS_PER_RANK), Capacity(factor=8.0)):
            for dispatcher in ("fused", "eager"):
                dropless = ep_step(ep_block(mesh, dispatcher, None, torch.float32, route, rank, world), x_all[rows],
                                 cotangent[rows])
                bounded = ep_block(mesh, dispatcher, capacity, torch.float32, route, rank, world)
                got = ep_step(bounded, x_all[rows], cotangent[rows])
                loads, dropped = fsdpturbo.expert_load(bounded, with_dropped=True)
                assert int(dropped["experts"].sum()) == 0
                assert int(loads["experts"].sum()) == world * TOKENS_PER_RANK * 2
                for name, value in got.items():
                    where = f"{dispatcher} {route_name} {capacity}"
                    if dispatcher == "fused":
                        assert torch.equal(value, dropless[name]), f"{where} {name}: differs from the dropless fused dispatch"
                    else:
                        (every if name.startswith("grad experts.") else local).check(name, value, where)


def test_enough_capacity_equals_the_dropless_dispatch():
    run_ranks(_enough_capacity_rank_fn, 2, 2)
    run_ranks(_enough_capacity_rank_fn, 4, 2)  # efsdp replicas: the EP gradient reduction over them


def _kept_slots(index, capacity):
    """Which slots of one rank an expert takes: its first `capacity` in slot order (plain Python)."""
    seen = collections.Counter()
    keep = []
    for expert in index.reshape(-1).tolist():
        keep.append(seen[expert] < capacity)
        seen[expert] += 1
    return torch.tensor(keep).view(index.shape)


def _masked_reference(world, capacity, dtype):
    """The Hugging Face block on every rank's tokens in one process, each slot's router weight
    zeroed where that rank's expert was over capacity."""
    block = moe_block(8, 2, dtype)
    original = block.gate.forward

    def forward(hidden):
        logits, weights, index = original(hidden)
        keep = torch.cat([_kept_slots(index[r * TOKENS_PER_RANK:(r + 1) * TOKENS_PER_RANK], capacity) for r in range(world)])
        return logits, weights * keep.to(weights.dtype), index

    block.gate.forward = forward
    x, cotangent = block_data(world, dtype)
    x.requires_grad_(True)
    out = block(x.unsqueeze(0)).squeeze(0)
    (out * cotangent).sum().backward()
    with torch.no_grad():
        index = original(x)[2]
    dropped = sum((~_kept_slots(index[r * TOKENS_PER_RANK:(r + 1) * TOKENS_PER_RANK], capacity)).sum() for r in range(world))
    return out.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}, int(dropped)


def _drop_rank_fn(rank, world, dispatcher):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    capacity = 1  # 5 tokens × top-2 over 8 experts: most experts get 2+ slots from a rank
    ref_out, ref_xgrad, ref_grads, ref_dropped = _masked_reference(world, capacity, torch.float64)
    block = ep_block(mesh, dispatcher, Capacity(tokens=capacity), torch.float64)
    x_all, cotangent = block_data(world, torch.float64)
    rows = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    got = ep_step(block, x_all[rows], cotangent[rows])
    tol = dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got["output"], ref_out[rows], **tol)
    torch.testing.assert_close(got["input grad"], ref_xgrad[rows], **tol)
    gate_grad = got["grad gate.weight"]
    dist.all_reduce(gate_grad)
    torch.testing.assert_close(gate_grad, ref_grads["gate.weight"], **tol)
    torch.testing.assert_close(got["grad experts.gate_up_proj"] * world, ref_grads["experts.gate_up_proj"], **tol)
    torch.testing.assert_close(got["grad experts.down_proj"] * world, ref_grads["experts.down_proj"], **tol)
    loads, dropped = fsdpturbo.expert_load(block, with_dropped=True)
    assert 0 < ref_dropped == int(dropped["experts"].sum())
    summary = fsdpturbo.expert_load_summary(loads, dropped)
    assert summary["dropped_tokens"] == ref_dropped and summary["tokens"] == world * TOKENS_PER_RANK * 2


@pytest.mark.parametrize("dispatcher", ["eager", "fused"])
def test_drop_skips_exactly_the_slots_over_capacity(dispatcher):
    run_ranks(_drop_rank_fn, 2, dispatcher)


def _fail_rank_fn(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    block = ep_block(mesh, "fused", Capacity(tokens=3, overflow="fail"), torch.float32, ROUTES["skewed"], rank,
                      world)
    x_all, _ = block_data(world, torch.float32)
    with pytest.raises(RuntimeError) as raised:
        block(x_all[rank * TOKENS_PER_RANK:(rank + 1) * TOKENS_PER_RANK].unsqueeze(0))
    assert ("fsdpturbo: experts: expert 0 got more rows than its capacity of 3 per rank (rank 0: 5, rank 1: 5); "
            "capacity_overflow is 'fail'") in str(raised.value)
    # Within capacity, `fail` runs as `drop` does.
    block = ep_block(mesh, "fused", Capacity(tokens=5, overflow="fail"), torch.float32, ROUTES["skewed"], rank,
                      world)
    block(x_all[rank * TOKENS_PER_RANK:(rank + 1) * TOKENS_PER_RANK].unsqueeze(0))


def test_fail_raises_on_every_rank_naming_layer_expert_and_counts():
    run_ranks(_fail_rank_fn, 2, timeout=120)


def _empty_rank_fn(rank, world):
    """Rank 0 forwards no token; rank 1 routes everything to rank 0's experts."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    tokens = 0 if rank == 0 else 3
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(7), dtype=torch.float64)[:tokens]
    index = torch.tensor([[0, 1]] * tokens, dtype=torch.int64)
    weights = torch.full((tokens, 2), 0.5, dtype=torch.float64)
    results = []
    for capacity in (None, Capacity(tokens=3)):
        block = ep_block(mesh, "fused", capacity, torch.float64)
        xi = x.clone().requires_grad_(True)
        out = block.experts(xi, index, weights)
        out.sum().backward()
        results.append([out.detach(), xi.grad, block.experts.gate_up_proj.grad.to_local()])
    for dropless, bounded in zip(*results):
        assert torch.equal(dropless, bounded)


def test_a_rank_without_tokens():
    run_ranks(_empty_rank_fn, 2)


def _no_sync_rank_fn(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    x_all, cotangent = block_data(world, torch.float32)
    rows = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    for dispatcher in ("eager", "fused"):
        block = ep_block(mesh, dispatcher, Capacity(factor=1.0), torch.float32)
        with no_host_sync():
            ep_step(block, x_all[rows], cotangent[rows])
    # The detector has teeth: the dropless dispatch reads the split sizes on the host.
    block = ep_block(mesh, "fused", None, torch.float32)
    with pytest.raises(HostSync, match="tolist"):
        with no_host_sync():
            ep_step(block, x_all[rows], cotangent[rows])
    dist.barrier()  # the other rank stopped at the same host read: no collective is left half done


def test_capacity_forward_and_backward_reach_no_host_sync():
    run_ranks(_no_sync_rank_fn, 2)


def test_capacity_arguments_are_checked():
    with pytest.raises(ValueError, match="exactly one of factor and tokens"):
        Capacity(factor=1.0, tokens=4)
    with pytest.raises(ValueError, match="finite number > 0, got 0"):
        Capacity(factor=0)
    with pytest.raises(ValueError, match="integer ≥ 1, got 2.5"):
        Capacity(tokens=2.5)
    with pytest.raises(ValueError, match=r"one of \['drop', 'fail'\], got 'spill'"):
        Capacity(tokens=4, overflow="spill")
    assert Capacity(factor=1.25).rows(tokens=10, top_k=2, num_experts=8) == 4  # ceil(1.25 · 20 / 8)
    assert Capacity(tokens=7).rows(tokens=10, top_k=2, num_experts=8) == 7
    with pytest.raises(ValueError, match=r"dispatchers \['eager', 'fused'\], got 'domino'"):
        fsdpturbo.moe.dispatch.get_dispatcher_fn("domino", None, capacity=Capacity(tokens=4))
