"""Dispatcher conformance on gloo ranks: for every dispatcher variant and a set of nasty routings,
a Hugging Face Qwen3-MoE sparse block's output and gradients (input, router, expert weights)
are bitwise equal run to run and equal to the block run in one process, per element within the
error model of `fsdpturbo.parity`, in float32 and bfloat16.

A new dispatcher variant is one more entry of DISPATCHERS: a name and the EPPlanConfig keywords
that select it."""
import pytest
import torch

import fsdpturbo
from dist_util import run_ranks
from fsdpturbo.moe.dispatch import Capacity
from fsdpturbo.ep import EPPlanConfig, expert_parallelize_modules
from blocks import moe_block, one_process_gates, override_router

pytestmark = pytest.mark.parity  # also run on the other instruction sets (ctest parity_*)

WORLD = 4
NUM_EXPERTS, TOP_K = 8, 2  # two local experts per EP rank at ep = 4
TOKENS = 5

# The capacity-bounded modes with room for every slot of every case (at most 7 tokens × top-2 on
# a rank): they must equal the dropless dispatch.
ENOUGH = Capacity(tokens=14)
DISPATCHERS = {  # name → EPPlanConfig keywords; the first is the reference of the cross-dispatcher bound
    "eager": dict(dispatcher="eager"),
    "fused": dict(dispatcher="fused"),
    "domino": dict(dispatcher="domino"),
    "capacity eager": dict(dispatcher="eager", capacity=ENOUGH),
    "capacity fused": dict(dispatcher="fused", capacity=ENOUGH),
}
# Variants that run the same kernels on the same rows as another: bitwise equal to it.
BITWISE_TWINS = {"capacity fused": "fused"}


def _choose(ids, tokens, seed):
    """`tokens` rows of TOP_K distinct ids drawn from `ids`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(ids)
    return torch.stack([ids[torch.randperm(len(ids), generator=g)[:TOP_K]] for _ in range(tokens)]) \
        if tokens else torch.zeros(0, TOP_K, dtype=torch.int64)


def _overloaded(rank, tokens):
    """Every token's first choice is expert 3; the second is random."""
    index = _choose([i for i in range(NUM_EXPERTS) if i != 3], tokens, rank)
    index[:, 0] = 3
    return index


# name → (tokens on each rank, forced route (rank, tokens) → ids [tokens, K], or None: the router's)
CASES = {
    "router": ([TOKENS] * WORLD, None),
    # Experts 1, 2, 4, 6 and 7 receive no token.
    "zero_token_experts": ([TOKENS] * WORLD, lambda rank, t: _choose([0, 3, 5], t, rank)),
    # No token goes to rank 2's experts (4, 5): that rank receives nothing and computes nothing.
    "idle_rank": ([TOKENS] * WORLD, lambda rank, t: _choose([0, 1, 2, 3, 6, 7], t, rank)),
    # Rank 1 has no tokens: it sends nothing, still takes part in every collective.
    "silent_rank": ([TOKENS, 0, TOKENS, TOKENS], None),
    # Both slots of a token name the same expert.
    "duplicates": ([TOKENS] * WORLD, lambda rank, t: torch.tensor([[(rank + i) % NUM_EXPERTS] * TOP_K
                                                                     for i in range(t)], dtype=torch.int64)),
    # Every token sends one slot to expert 3 (rank 1): one expert of eight holds half of all rows.
    "overloaded": ([TOKENS] * WORLD, _overloaded),
    # Uneven token counts and so uneven splits in both all-to-alls.
    "uneven": ([7, 3, 5, 1], None),
}

def _inputs(rank, tokens, dtype):
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(tokens, 16, generator=g, dtype=torch.float64).to(dtype)
    cotangent = torch.randn(tokens, 16, generator=g, dtype=torch.float64).to(dtype)
    return x, cotangent


def _route(case, rank, tokens):
    route = CASES[case][1]
    return None if route is None else route(rank, tokens)


def _ep_block(plan_kwargs, dtype, case, rank, mesh):
    block = moe_block(NUM_EXPERTS, TOP_K, dtype)
    if CASES[case][1] is not None:
        override_router(block, lambda tokens: _route(case, rank, tokens))
    expert_parallelize_modules(block, mesh, EPPlanConfig(apply_modules=["experts"], **plan_kwargs))
    return block


def _step(block, dtype, case, rank):
    """One forward and backward: {output, input grad, router grad, expert weight grads}."""
    for p in block.parameters():
        p.grad = None
    x, cotangent = _inputs(rank, CASES[case][0][rank], dtype)
    x.requires_grad_(True)
    out = block(x.unsqueeze(0)).squeeze(0)
    (out * cotangent).sum().backward()
    return {"output": out.detach(), "input grad": x.grad, "grad gate.weight": block.gate.weight.grad,
            "grad experts.gate_up_proj": block.experts.gate_up_proj.grad.full_tensor(),
            "grad experts.down_proj": block.experts.down_proj.grad.full_tensor()}


def _conformance_rank_fn(rank, world, dtype_name):
    dtype = getattr(torch, dtype_name)
    mesh = fsdpturbo.ParallelState(world, ep_size=world).init_device_meshes("cpu").sub_mesh("ep")
    for case in CASES:
        counts = CASES[case][0]
        local, every = one_process_gates(dtype, [_inputs(r, counts[r], dtype) for r in range(world)],
                                         [_route(case, r, counts[r]) for r in range(world)], rank)
        results = {}
        for name, plan_kwargs in DISPATCHERS.items():
            where = f"{name} {case} {dtype_name} rank {rank}"
            first = _step(_ep_block(plan_kwargs, dtype, case, rank, mesh), dtype, case, rank)
            block = _ep_block(plan_kwargs, dtype, case, rank, mesh)
            runs = [_step(block, dtype, case, rank), _step(block, dtype, case, rank)]  # fresh, then the same module
            for again in runs:
                for what, value in first.items():
                    assert torch.equal(again[what], value), f"{where}: {what} differs between runs"
            results[name] = first
            if case == "idle_rank" and rank == 2:  # the route does what it says: nothing reached this rank
                local_experts = slice(2 * NUM_EXPERTS // world, 3 * NUM_EXPERTS // world)
                assert not first["grad experts.gate_up_proj"][local_experts].any(), where
                assert not first["grad experts.down_proj"][local_experts].any(), where
            for what, value in first.items():
                (every if what.startswith("grad experts.") else local).check(what, value, where)
        for name, twin in BITWISE_TWINS.items():
            for what, value in results[name].items():
                assert torch.equal(value, results[twin][what]), f"{name} {case} {dtype_name} rank {rank}: {what}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dispatchers_bitwise_run_to_run_and_equal_to_one_process(dtype):
    run_ranks(_conformance_rank_fn, WORLD, dtype, timeout=300)
