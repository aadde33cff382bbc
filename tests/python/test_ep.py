"""Expert parallelism on gloo ranks against a real Hugging Face Qwen3-MoE sparse block run in
one process on all tokens: outputs, input gradients, router gradients and expert gradients."""
import pytest
import torch
import torch.distributed as dist

import fsdpturbo
from dist_util import run_ranks
from fsdpturbo.ep import EPPlanConfig, expert_parallelize_modules
from blocks import ROUTES, TOKENS_PER_RANK, block_data, ep_block, ep_step, moe_block, one_process_gates, override_router

# also run against LlamaFactory's transformers; and on the other instruction sets (ctest parity_*)
pytestmark = [pytest.mark.transformers_5_8, pytest.mark.parity]


def _reference(num_experts, top_k, dtype, world, route_override, family):
    block = moe_block(num_experts, top_k, dtype, family=family)
    x, cotangent = block_data(world, dtype)
    x.requires_grad_(True)
    if route_override is not None:
        override_router(block, route_override)
    out = block(x.unsqueeze(0)).squeeze(0)
    (out * cotangent).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}


def _ep_rank_fn(rank, world, ep, dispatcher, num_experts, top_k, route_name, family="qwen3_moe"):
    """The block in float64 under EP against the same block in one process on every rank's tokens."""
    dtype = torch.float64
    route_override = ROUTES[route_name]
    ref_out, ref_xgrad, ref_grads = _reference(num_experts, top_k, dtype, world, route_override, family)
    block = moe_block(num_experts, top_k, dtype, family=family)
    if route_override is not None:
        override_router(block, lambda t: route_override(world * TOKENS_PER_RANK)[rank * t:(rank + 1) * t])
    if world == 1:
        # One process, every expert local (the fused dispatcher skips the local reorder).
        ep_mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    else:
        ep_mesh = fsdpturbo.ParallelState(world, ep_size=ep).init_device_meshes("cpu").sub_mesh("ep")
    plan = EPPlanConfig(apply_modules=["experts"], dispatcher=dispatcher)
    expert_parallelize_modules(block, ep_mesh, plan)
    _check_ep_state(block, num_experts, ep, ep_mesh.get_local_rank())

    x_all, cotangent = block_data(world, dtype)
    rows = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    x = x_all[rows].clone().requires_grad_(True)
    out = block(x.unsqueeze(0)).squeeze(0)
    (out * cotangent[rows]).sum().backward()

    tol = dict(rtol=1e-9, atol=1e-9)  # float64: many orders of magnitude above its rounding
    torch.testing.assert_close(out.detach(), ref_out[rows], **tol)
    torch.testing.assert_close(x.grad, ref_xgrad[rows], **tol)
    # Router and shared-expert parameters stay local: their gradients summed over all ranks.
    for name, param in block.named_parameters():
        if name.startswith("experts."):
            continue
        grad = param.grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(grad, ref_grads[name], **tol)
    # Expert gradients: EP alone sums them over the ranks holding the same experts (the
    # replicas, here efsdp) and divides by F = world (each rank's loss here is a sum, not a
    # mean, so F times the gradient is the reference's).
    local = num_experts // ep
    ep_rank = ep_mesh.get_local_rank()
    for name in ("gate_up_proj", "down_proj"):
        grad = getattr(block.experts, name).grad.to_local() * world
        torch.testing.assert_close(grad, ref_grads[f"experts.{name}"][ep_rank * local:(ep_rank + 1) * local], **tol)


def _check_ep_state(block, num_experts, ep, ep_rank):
    """The EP module's one state object (found by `ep_modules`, nothing in it a tensor: meta
    initialisation materialises the module later) and the seed's attributes as read-only views of
    it, `expert_ids_per_ep_rank` also with one local expert; the module's class keeps its name."""
    from fsdpturbo.moe.ep_state import ep_modules, state

    experts, local = block.experts, num_experts // ep
    assert ep_modules(block) == [("experts", experts)] and state(experts).name == "experts"
    assert state(experts).tally.counts is None and not list(experts.buffers())
    assert not any(isinstance(v, torch.Tensor) for v in vars(state(experts)).values())
    assert type(experts).__name__ == type(experts).__bases__[-1].__name__
    assert (experts.num_global_experts, experts.num_local_experts) == (num_experts, local)
    assert experts.local_expert_indices == list(range(ep_rank * local, (ep_rank + 1) * local))
    assert experts.expert_ids_per_ep_rank == [i % local for i in range(num_experts)]
    with pytest.raises(AttributeError):
        experts.num_local_experts = 1


@pytest.mark.parametrize("world,ep", [(1, 1), (2, 2), (4, 2), (4, 4), (6, 2), (8, 4)])
@pytest.mark.parametrize("dispatcher", ["eager", "fused", "domino"])
def test_ep_block_equals_single_process_f64(world, ep, dispatcher):
    run_ranks(_ep_rank_fn, world, ep, dispatcher, 8, 2, "router")


@pytest.mark.parametrize("route", ["skewed", "duplicates"])
@pytest.mark.parametrize("dispatcher", ["eager", "fused"])
def test_edge_routes(route, dispatcher):
    run_ranks(_ep_rank_fn, 4, 4, dispatcher, 8, 2, route)


def test_experts_equal_ep_one_local_expert():
    run_ranks(_ep_rank_fn, 4, 4, "eager", 4, 2, "router")


@pytest.mark.parametrize("dispatcher", ["eager", "fused", "domino"])
def test_qwen3_5_block_with_shared_expert(dispatcher):
    run_ranks(_ep_rank_fn, 4, 2, dispatcher, 8, 2, "router", "qwen3_5_moe")


def _f32_rank_fn(rank, world, ep):
    """float32 EP blocks (every dispatcher) through the parity gates of the same block in one
    process (fsdpturbo.parity, blocks.one_process_gates): output, input and router gradients on
    this rank's tokens, the experts' gradients on every rank's."""
    mesh = fsdpturbo.ParallelState(world, ep_size=ep).init_device_meshes("cpu").sub_mesh("ep")
    x_all, cotangent = block_data(world, torch.float32)
    inputs = [(x_all[r * TOKENS_PER_RANK:(r + 1) * TOKENS_PER_RANK],
               cotangent[r * TOKENS_PER_RANK:(r + 1) * TOKENS_PER_RANK]) for r in range(world)]
    local, every = one_process_gates(torch.float32, inputs, [None] * world, rank)
    for dispatcher in ("eager", "fused", "domino"):
        got = ep_step(ep_block(mesh, dispatcher, None, torch.float32), *inputs[rank])
        for name, value in got.items():
            (every if name.startswith("grad experts.") else local).check(name, value, f"{dispatcher} rank {rank}")


def test_f32_equals_single_process_within_the_parity_gate():
    run_ranks(_f32_rank_fn, 4, 2)


def _bad_ids_rank_fn(rank, world):
    block = moe_block(4, 2, torch.float64)
    state = fsdpturbo.ParallelState(world, ep_size=world).init_device_meshes("cpu")
    expert_parallelize_modules(block, state.sub_mesh("ep"), EPPlanConfig(apply_modules=["experts"], dispatcher="eager"))
    x = torch.randn(3, 16, dtype=torch.float64)
    index = torch.tensor([[0, 1], [2, 3], [1, 2]])
    if rank == 1:
        index[2, 1] = 4  # one past the last expert
    with pytest.raises(ValueError) as raised:
        block.experts(x, index, torch.full((3, 2), 0.5, dtype=torch.float64))
    if rank == 1:
        assert "expert id 4 at token 2, slot 1 is outside [0, 4)" in str(raised.value)
    else:
        assert "expert ids outside [0, 4) on rank(s) [1]" in str(raised.value)


def test_out_of_range_ids_fail_on_every_rank_without_hanging():
    run_ranks(_bad_ids_rank_fn, 2, timeout=120)


def _zero_tokens_rank_fn(rank, world):
    """Rank 0 has no tokens at all; rank 1 routes everything to rank 0's experts."""
    block = moe_block(4, 2, torch.float64)
    reference = moe_block(4, 2, torch.float64)
    state = fsdpturbo.ParallelState(world, ep_size=world).init_device_meshes("cpu")
    expert_parallelize_modules(block, state.sub_mesh("ep"), EPPlanConfig(apply_modules=["experts"], dispatcher="domino"))
    tokens = 0 if rank == 0 else 3
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 16, generator=g, dtype=torch.float64)[:tokens]
    index = torch.tensor([[0, 1]] * tokens, dtype=torch.int64)
    weights = torch.full((tokens, 2), 0.5, dtype=torch.float64)
    out = block.experts(x, index, weights)
    out.sum().backward()
    # HF's own experts loop cannot take zero tokens (one_hot of an empty index); nothing is the answer.
    expected = reference.experts(x, index, weights) if tokens else torch.zeros(0, 16, dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert block.experts.gate_up_proj.grad is not None  # every rank takes part in the backward


def test_rank_with_zero_tokens_and_ranks_that_receive_nothing():
    run_ranks(_zero_tokens_rank_fn, 2)


def _user_dispatcher(ep_group, module, hidden_states, top_k_index, top_k_weights):
    """A user callable, bound to the EP group as the seed does: delegates to eager."""
    module.user_calls = getattr(module, "user_calls", 0) + 1
    from fsdpturbo.moe.dispatch.eager import eager_forward

    return eager_forward(module, hidden_states, top_k_index, top_k_weights, ep_group=ep_group)


def _callable_rank_fn(rank, world):
    block = moe_block(4, 2, torch.float64)
    reference = moe_block(4, 2, torch.float64)
    state = fsdpturbo.ParallelState(world, ep_size=world).init_device_meshes("cpu")
    expert_parallelize_modules(block, state.sub_mesh("ep"),
                               EPPlanConfig(apply_modules=["experts"], dispatcher=_user_dispatcher))
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    index = torch.tensor([[0, 3], [1, 2], [3, 0]])
    weights = torch.rand(3, 2, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    # Swapped arguments and full router probabilities [T, E] are normalised like the seed's.
    probs = torch.zeros(3, 4, dtype=torch.float64).scatter(1, index, weights)
    out = block.experts(x, probs, index)
    torch.testing.assert_close(out, reference.experts(x, index, weights), rtol=1e-12, atol=1e-12)
    assert block.experts.user_calls == 1


def test_user_callable_dispatcher_and_argument_normalisation():
    run_ranks(_callable_rank_fn, 2)


def test_unknown_and_npu_only_dispatchers_fail_when_the_plan_is_made():
    from fsdpturbo.ep import get_dispatcher_fn

    with pytest.raises(RuntimeError, match=r"Unsupported dispatcher moonep2\. "
                                           r"Supported: \['domino', 'eager', 'fused', 'mc2'\]"):
        get_dispatcher_fn("moonep2", None)
    with pytest.raises(NotImplementedError, match=r"The 'moonep' dispatcher is not implemented by fsdpturbo"):
        get_dispatcher_fn("moonep", None)
    with pytest.raises(RuntimeError, match=r"'mc2' dispatcher runs only on Ascend NPUs"):
        get_dispatcher_fn("mc2", None)


def _compile_rank_fn(rank, world):
    """torch.compile of an EP block (dynamo, eager backend: graph breaks at the host copies of
    the counts) gives eager's outputs and gradients for every dispatcher."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    x_all, cotangent = block_data(world, torch.float64)
    rows = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    for dispatcher in ("eager", "fused", "domino"):
        results = []
        for compiled in (False, True):
            block = moe_block(8, 2, torch.float64)
            expert_parallelize_modules(block, mesh, EPPlanConfig(apply_modules=["experts"], dispatcher=dispatcher))
            run = torch.compile(block, backend="eager") if compiled else block
            x = x_all[rows].clone().requires_grad_(True)
            out = run(x.unsqueeze(0)).squeeze(0)
            (out * cotangent[rows]).sum().backward()
            results.append([out.detach(), x.grad, block.experts.gate_up_proj.grad.to_local(), block.gate.weight.grad])
        for want, got in zip(*results):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_torch_compile_of_an_ep_block_equals_eager():
    run_ranks(_compile_rank_fn, 1, timeout=300)
