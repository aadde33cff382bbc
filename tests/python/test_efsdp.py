"""`expert_fully_shard_modules` at the MoE-block level, under the outer FSDP2 that owns the
router and shared expert: with context parallelism (each CP rank holds a chunk of every
sequence, the loss is the whole sequence's on each of them, as in `ulysses`) the gradients of
experts and router equal the single-process gradient of the mean loss over every token; the
seed's errors for hook modules and implementations."""
import pytest
import torch

from dist_util import run_ranks
from models import full
from blocks import TOKENS_PER_RANK, block_data, moe_block

# also run against LlamaFactory's transformers; and on the other instruction sets (ctest parity_*)
pytestmark = [pytest.mark.transformers_5_8, pytest.mark.parity]


class _Layer(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.mlp = block

    def forward(self, x):
        return self.mlp(x)


def _loss(layer, x, cotangent, cp_group=None):
    """Mean over the tokens of a per-token loss; with `cp_group`, `x` is this rank's chunk of a
    sequence split over the group and the mean is over the whole sequence."""
    import ulysses

    out = layer(x.unsqueeze(0)).squeeze(0)
    numerator = (out * cotangent).sum()
    if cp_group is not None:
        numerator = ulysses.gather_sequence(numerator.reshape(1), cp_group, dim=0).sum()
        return numerator / (len(x) * torch.distributed.get_world_size(cp_group))
    return numerator / len(x)


def _cp_rank_fn(rank, world, layouts):
    for cp, ep, efsdp, family in layouts:
        _check_layout(rank, world, cp, ep, efsdp, family)


def _check_layout(rank, world, cp, ep, efsdp, family):
    import fsdpturbo
    from fsdpturbo.efsdp import FSDPPlanConfig, expert_fully_shard_modules
    from fsdpturbo.engine import fully_shard_outer
    from fsdpturbo.ep import EPPlanConfig, expert_parallelize_modules

    state = fsdpturbo.ParallelState(world, cp_size=cp, ep_size=ep, efsdp_size=efsdp).init_device_meshes("cpu")
    assert state.size("expert_cp") == cp
    from fsdpturbo.parity import Reference

    x, cotangent = block_data(world, torch.float32)
    reference = Reference(_Layer(moe_block(8, 2, torch.float32, family=family)))
    gate = reference.step(lambda model, order: _loss(model, x[order], cotangent[order]).backward(), rows=len(x))

    layer = _Layer(moe_block(8, 2, torch.float32, family=family))
    plan = EPPlanConfig(apply_modules=["mlp.experts"], dispatcher="eager", apply_efsdp_modules=["mlp"])
    expert_parallelize_modules(layer, state.sub_mesh("ep"), plan)
    assert expert_fully_shard_modules(layer, state.sub_mesh("efsdp"), plan, FSDPPlanConfig(apply_modules={})) is layer
    # The router and shared expert belong to the outer FSDP2 over dp (experts ignored there).
    experts = list(layer.mlp.experts.parameters())
    fully_shard_outer(layer, state.sub_mesh("dp"), float(world), ignored_params=experts)
    # Rank r = d · cp + c holds chunk c of sequence d (rows d · cp · T ... (d + 1) · cp · T).
    rows = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    cp_group = state.sub_mesh("cp").get_group() if cp > 1 else None
    _loss(layer, x[rows], cotangent[rows], cp_group).backward()
    gate.check_all({f"grad {name}": full(param.grad) for name, param in layer.named_parameters()},
                   f"cp={cp} ep={ep} efsdp={efsdp}")


def test_expert_and_router_gradients_are_reduced_over_every_replica():
    """4 ranks; (cp 2, ep 2): sequences split over CP groups, experts replicated over expert_cp;
    (ep 2, efsdp 2): the router and shared expert replicated over ep."""
    layouts = [(2, 2, 1, "qwen3_moe"), (2, 2, 1, "qwen3_5_moe"), (1, 2, 2, "qwen3_5_moe")]
    run_ranks(_cp_rank_fn, 4, layouts, timeout=200)


def _model_with_experts():
    return _Layer(moe_block(4, 2, torch.float32))


def test_seed_errors_before_any_mesh_is_used():
    from fsdpturbo.efsdp import FSDPPlanConfig, expert_fully_shard_modules
    from fsdpturbo.ep import EPPlanConfig

    plan = EPPlanConfig(apply_modules=["mlp.experts"], dispatcher="eager", apply_efsdp_modules=["mlp"])
    with pytest.raises(ValueError, match=r"Unknown FSDP implementation: fancy\. Supported: \['custom', 'native'\]"):
        expert_fully_shard_modules(_model_with_experts(), object(), plan, FSDPPlanConfig(fsdp_implementation="fancy"))
    with pytest.raises(NotImplementedError, match="'custom'"):
        expert_fully_shard_modules(_model_with_experts(), object(), plan, FSDPPlanConfig(fsdp_implementation="custom"))
    with pytest.raises(RuntimeError, match=r"\[FSDP2\] No module named \['model.layers.\{\*\}.mlp'\]\."):
        expert_fully_shard_modules(_model_with_experts(), object(), plan,
                                   FSDPPlanConfig(apply_modules={}, hook_modules=["model.layers.{*}.mlp"]))
    plan.apply_efsdp_modules = ["nothing"]
    with pytest.raises(RuntimeError, match=r"\[Expert Fully Shard\] No module named EPPlanConfig"):
        expert_fully_shard_modules(_model_with_experts(), object(), plan, FSDPPlanConfig(apply_modules={}))


def test_hook_modules_in_post_order_and_ignored_without_apply_modules():
    from fsdpturbo.efsdp import FSDPPlanConfig, get_fsdp_hook_modules

    model = _model_with_experts()
    hooks = get_fsdp_hook_modules(model, FSDPPlanConfig(apply_modules={}, hook_modules=["*"]))
    assert hooks[-1] is model and hooks[-2] is model.mlp and hooks.index(model.mlp.experts) < hooks.index(model.mlp)
    assert get_fsdp_hook_modules(model, FSDPPlanConfig(hook_modules=["nothing"])) == []
