"""Ulysses context parallelism in FSDPTurbo's standalone API (`ulysses_parallel_size`,
`cp_plan`: full_attention, gated_delta_net, causal_lm_loss) on 4 gloo ranks at ulysses 2 ×
ep 2: each data rank's sequence is split over its Ulysses group, and the loss, every gradient,
the grad norm and the parameters after each of 3 AdamW steps equal one process's Hugging Face
model on the whole sequences, element by element within `fsdpturbo.parity`'s error model
(Qwen3-MoE, and Qwen3.5-MoE with its linear attention and multi-axis mRoPE ids); the parallel
state's Ulysses and data groups; the errors that need a world or a model."""
import pytest
import torch
import torch.distributed as dist

from dist_util import run_ranks
from models import LR, SEQ, STEPS, batch, build_model, full, loss_and_norm_step, positions

pytestmark = pytest.mark.transformers_5_8

EXPERTS = "model.layers.{*}.mlp.experts"
LOSS = [{"target_functions": ["transformers.loss.loss_utils.ForCausalLMLoss"], "type": "causal_lm_loss"}]


def ulysses_patches(family):
    """verl's cp_plan for `family`: the modeling file's eager attention, Qwen3.5's gated delta net."""
    modeling = f"transformers.models.{family}.modeling_{family}"
    patches = [{"target_functions": [f"{modeling}.eager_attention_forward"], "type": "full_attention"}]
    if family == "qwen3_5_moe":
        patches.append({"target_functions": [f"{modeling}.Qwen3_5MoeGatedDeltaNet.forward"],
                        "type": "gated_delta_net"})
    return patches


def cp_config(family, fsdp=4, ulysses=2, ep=2, function_patches=None, loss_patches=LOSS):
    from fsdp_turbo.fsdp_turbo_config import (CPPlanConfig, DistributedConfig, EPPlanConfig, FSDPPlanConfig,
                                              FSDPTurboConfig)

    patches = ulysses_patches(family) if function_patches is None else function_patches
    return FSDPTurboConfig(distributed=DistributedConfig(
        fully_shard_parallel_size=fsdp, ulysses_parallel_size=ulysses,
        cp_plan=CPPlanConfig(ulysses_function_patches=patches, loss_function_patches=loss_patches),
        expert_parallel_size=ep, ep_plan=EPPlanConfig(apply_modules=[EXPERTS]),
        fsdp_plan=FSDPPlanConfig(apply_modules={"model.layers.{*}": {}})))


def eager_model(family):
    model = build_model(family)
    model.set_attn_implementation("eager")
    return model


def _train_rank_fn(rank, world, family):
    from fsdp_turbo.distributed.parallel_state import reset_parallel_state
    from fsdp_turbo.fsdp_turbo import FSDPTurbo
    from fsdp_turbo.training.clip_grads import clip_grad_norm
    from fsdpturbo.parity import Reference
    from fsdpturbo.ulysses import chunk

    wrapper = FSDPTurbo(cp_config(family), eager_model(family))
    model, state = wrapper.model, wrapper.parallel_state
    cp, dp = state.get_ulysses_group_size(), state.get_data_group_size()
    group = state.get_ulysses_group()
    assert (cp, dp) == (2, 2) and state.get_data_rank() == rank // 2 and state.get_ulysses_rank() == rank % 2
    assert dist.get_process_group_ranks(group) == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert dist.get_process_group_ranks(state.get_data_group()) == [rank % 2, rank % 2 + 2]
    reference = Reference(build_model(family), optimizer=lambda params: torch.optim.AdamW(params, lr=LR))
    optimizer = torch.optim.AdamW(wrapper.parameters(), lr=LR)
    for step in range(STEPS):
        where = f"{family} ulysses 2 ep 2 step {step}"
        reference.load({name: full(param) for name, param in model.named_parameters()})
        ids = batch(step, world).view(dp, cp * SEQ)  # the same tokens as without CP, sequences cp times as long
        row = ids[state.get_data_rank()][None]
        position_ids = positions(family, dp, cp * SEQ)
        loss = wrapper(input_ids=chunk(row, group), position_ids=chunk(positions(family, 1, cp * SEQ), group),
                       labels=chunk(row, group)).loss
        loss.backward()
        gate = reference.step(loss_and_norm_step(ids, position_ids), rows=dp)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=state.get_data_group())
        gate.check("loss", mean_loss / dp, where)
        gate.check_all({f"grad {n}": full(p.grad) for n, p in model.named_parameters()}, where)
        gate.check("grad norm", clip_grad_norm(model=wrapper, max_norm=1.0), where)
        gate = reference.optimizer_step({n: full(p.grad) for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        gate.check_all({n: full(p) for n, p in model.named_parameters()}, f"{where}, after the step")
    reset_parallel_state()


@pytest.mark.parity
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_ulysses_2_ep_2_trains_as_one_process(family):
    run_ranks(_train_rank_fn, 4, family, timeout=400)


def _errors_rank_fn(rank, world):
    from fsdp_turbo.config_check import ConfigError
    from fsdp_turbo.distributed.parallel_state import init_parallel_state, reset_parallel_state
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    def refused(make, start):
        with pytest.raises(ConfigError) as caught:
            make()
        assert len(caught.value.problems) == 1 and caught.value.problems[0].startswith(start), caught.value.problems
        reset_parallel_state()

    refused(lambda: init_parallel_state(cp_config("qwen3_moe", ulysses=3)),
            "distributed.ulysses_parallel_size: 3 does not divide the world size 4; accepted: 1, 2, 4")
    refused(lambda: init_parallel_state(cp_config("qwen3_moe", ep=4)),
            "distributed.expert_parallel_size (4, ep_size) and expert_fully_shard_parallel_size (1, efsdp_size) with "
            "ulysses_parallel_size (2, cp_size; dp_size = world / it) on 4 ranks: dp_size must be divisible by ep_size")
    refused(lambda: FSDPTurbo(cp_config("qwen3_moe"), build_model("qwen3_moe")),  # sdpa
            "distributed.cp_plan.ulysses_function_patches: full_attention wraps the eager attention function, but "
            "Qwen3MoeForCausalLM attends with 'sdpa'")
    refused(lambda: FSDPTurbo(cp_config("qwen3_moe", loss_patches=[
        {"target_functions": ["transformers.loss.loss_utils.ForMaskedLMLoss"], "type": "causal_lm_loss"}]),
        eager_model("qwen3_moe")),
        "distributed.cp_plan.loss_function_patches[0].target_functions[0]: "
        "'transformers.loss.loss_utils.ForMaskedLMLoss' is not the loss function of Qwen3MoeForCausalLM")
    refused(lambda: FSDPTurbo(cp_config("qwen3_moe", function_patches=[
        {"target_functions": ["transformers.models.qwen3_moe.modeling_qwen3_moe.NoSuchAttention.forward"],
         "type": "full_attention"}]), eager_model("qwen3_moe")),
        "distributed.cp_plan.ulysses_function_patches[0].target_functions[0]: "
        "'transformers.models.qwen3_moe.modeling_qwen3_moe.NoSuchAttention.forward' cannot be resolved")

    wrapper = FSDPTurbo(cp_config("qwen3_moe", loss_patches=[]), eager_model("qwen3_moe"))
    ids = torch.zeros(1, SEQ // 2, dtype=torch.long)
    with pytest.raises(ValueError, match="loss_function_patches is empty, so the loss would not shift"):
        wrapper(input_ids=ids, position_ids=ids, labels=ids)
    with pytest.raises(ValueError, match="no position_ids were passed"):
        wrapper(input_ids=ids)
    reset_parallel_state()


def test_cp_errors_name_the_field_and_what_is_accepted():
    run_ranks(_errors_rank_fn, 4, timeout=300)
