"""FSDPTurbo's standalone API on 4 gloo ranks: the ms-swift fork's shape (an `FSDPTurboConfig`
built field by field as its `build_fsdpturbo_config` does, a meta model on every rank,
`FSDPTurbo(config, model)`, the weights broadcast from rank 0 with `set_model_state_dict`,
`training.clip_grads.clip_grad_norm`) trained three AdamW steps against one process
(`fsdpturbo.parity`); the parallel state; the errors that need a world or a model."""
import pytest
import torch
import torch.distributed as dist

from dist_util import run_ranks
from models import LR, STEPS, batch, build_model, full, loss_and_norm_step

pytestmark = pytest.mark.transformers_5_8  # also against the transformers verl and LlamaFactory pin

EXPERTS = "model.layers.{*}.mlp.experts"


def swift_config(fsdp, ep, efsdp, dispatcher, module_patches):
    """The ms-swift fork's `build_fsdpturbo_config` for a Qwen3-MoE spec, field by field, at cp
    size 1 (empty CP patches) and tp size 1 (its spec's TP modules are passed all the same)."""
    from fsdp_turbo.fsdp_turbo_config import (CheckpointConfig, CPPlanConfig, DataConfig, DistributedConfig,
                                              EPPlanConfig, FSDPPlanConfig, FSDPTurboConfig, MemoryConfig,
                                              ModelConfig, OptimizerConfig, TPPlanConfig, TrainRunConfig)

    return FSDPTurboConfig(
        module_patches=module_patches,
        model=ModelConfig(model_name_or_path="/local/model", tokenizer_name_or_path="/local/model",
                          torch_dtype=torch.float32),
        optimizer=OptimizerConfig(optimizer_type="AdamW", weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                                  adam_epsilon=1e-8, lr=LR, warmup_ratio=0, lr_scheduler_type="constant",
                                  clip_grad=1.0),
        data=DataConfig(dataset_path="/local/data.jsonl", batch_size=1, max_seq_length=6, num_workers=0,
                        pin_memory=False, shuffle=False),
        run=TrainRunConfig(seed=42, max_steps=STEPS, num_train_epochs=1, gradient_accumulation_steps=1,
                           logging_steps=1),
        checkpoint=CheckpointConfig(output_dir="/local/output", resume_from_checkpoint=None, save_steps=2 ** 31 - 1,
                                    save_optim=True, load_optim=True),
        distributed=DistributedConfig(
            fully_shard_parallel_size=fsdp,
            tensor_parallel_size=1,
            ulysses_parallel_size=1,
            cp_plan=CPPlanConfig(ulysses_function_patches=[], loss_function_patches=[]),
            expert_parallel_size=ep,
            expert_fully_shard_parallel_size=efsdp,
            fsdp_plan=FSDPPlanConfig(ignored_modules=[], apply_modules={"model.layers.{*}": {}, "lm_head": {}},
                                     param_dtype=None, reduce_dtype="fp32", output_dtype=None,
                                     num_to_forward_prefetch=1, num_to_backward_prefetch=1,
                                     hook_modules=["model.layers.{*}.mlp"], cpu_offload=False, pin_memory=False,
                                     fsdp_implementation="native"),
            tp_plan=TPPlanConfig(colwise_parallel=["model.layers.{*}.self_attn.q_proj"],
                                 rowwise_parallel=["model.layers.{*}.self_attn.o_proj"], sequence_parallel=[]),
            ep_plan=EPPlanConfig(apply_modules=[EXPERTS], apply_efsdp_modules=[EXPERTS], dispatcher=dispatcher)),
        memory=MemoryConfig(recompute=True, recompute_plan=["model.layers.{*}"]))


def meta_model():
    """Parameters on meta, buffers real (accelerate's `init_empty_weights(include_buffers=False)`)."""
    from fsdpturbo.weights import meta_parameters

    with meta_parameters():
        return build_model("qwen3_moe")


def load_from_rank0(model, source):
    """The weights of `source` (rank 0's full model; None elsewhere) broadcast into the wrapped
    `model`, as verl and the ms-swift fork load them; non-persistent buffers (rotary) kept."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
    set_model_state_dict(model, source.state_dict() if source is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


# The RMSNorm forward, through a module patch that counts its calls (the numbers stay HF's).
NORM_CALLS = []


def counted_rms_norm_forward(self, hidden_states):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    NORM_CALLS.append(1)
    return Qwen3MoeRMSNorm.forward(self, hidden_states)


def _assert_units_as_configured(model, plan):
    """Every unit of `apply_modules` (the decoder layers, then `lm_head`) has the plan's offload
    policy and prefetches the next unit in forward and the previous one in backward
    (num_to_*_prefetch 1)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    states = [unit._get_fsdp_state() for unit in [*model.model.layers, model.lm_head]]
    for i, state in enumerate(states):
        assert isinstance(state._fsdp_param_group.offload_policy, CPUOffloadPolicy) == plan.cpu_offload, i
        assert state._states_to_forward_prefetch == states[i + 1:i + 2], i
        assert state._states_to_backward_prefetch == states[max(0, i - 1):i], i


def _swift_rank_fn(rank, world, layouts):
    from fsdp_turbo.distributed.parallel_state import reset_parallel_state
    from fsdp_turbo.fsdp_turbo import FSDPTurbo
    from fsdp_turbo.training.clip_grads import clip_grad_norm
    from fsdpturbo.parity import Reference

    patch = {"target": "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeRMSNorm.forward",
             "replacement": f"{__name__}.counted_rms_norm_forward"}
    for fsdp, ep, efsdp, dispatcher in layouts:
        where = f"fsdp {fsdp} ep {ep} efsdp {efsdp} {dispatcher}"
        config = swift_config(fsdp, ep, efsdp, dispatcher, [patch])
        model = meta_model()
        names = {n: tuple(p.shape) for n, p in model.named_parameters()}
        # swift sets this after construction (its fp32 parameters kept whole); read at wrap time,
        # as is verl's `cpu_offload` (set here on the fused layout)
        config.distributed.fsdp_plan.ignored_params = ["model.norm.weight"]
        config.distributed.fsdp_plan.cpu_offload = dispatcher == "fused"
        wrapper = FSDPTurbo(config, model)
        assert wrapper.model is model and {n: tuple(p.shape) for n, p in model.named_parameters()} == names
        assert type(model.model.norm.weight) is torch.nn.Parameter and not hasattr(model.model.norm.weight, "placements")
        _assert_units_as_configured(model, config.distributed.fsdp_plan)
        load_from_rank0(model, build_model("qwen3_moe") if rank == 0 else None)
        state = wrapper.parallel_state
        reference = Reference(build_model("qwen3_moe"), optimizer=lambda params: torch.optim.AdamW(params, lr=LR))
        optimizer = torch.optim.AdamW(wrapper.parameters(), lr=LR)
        NORM_CALLS.clear()
        for step in range(STEPS):
            reference.load({name: full(param) for name, param in model.named_parameters()})
            ids = batch(step, state.get_data_group_size())
            row = ids[state.get_data_rank()][None]
            loss = wrapper(input_ids=row, labels=row).loss
            loss.backward()
            gate = reference.step(loss_and_norm_step(ids), rows=len(ids))
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss, group=state.get_data_group())
            gate.check("loss", mean_loss / state.get_data_group_size(), f"{where} step {step}")
            gate.check_all({f"grad {n}": full(p.grad) for n, p in model.named_parameters()}, f"{where} step {step}")
            norm = clip_grad_norm(model=wrapper, max_norm=1.0)
            assert type(norm) is float
            gate.check("grad norm", norm, f"{where} step {step}")
            gate = reference.optimizer_step({n: full(p.grad) for n, p in model.named_parameters()})
            optimizer.step()
            optimizer.zero_grad()
            gate.check_all({n: full(p) for n, p in model.named_parameters()}, f"{where} after step {step}")
        assert NORM_CALLS, "the module patch was not applied"
        reset_parallel_state()


@pytest.mark.parity
def test_swift_shape_trains_as_one_process():
    """(fsdp 4, ep 2, efsdp 2, eager) and HSDP (fsdp 2 × data 2, ep 4, fused, CPU offload), with
    recompute, prefetch, hook modules, a class-member module patch and a parameter kept whole."""
    run_ranks(_swift_rank_fn, 4, [(4, 2, 2, "eager"), (2, 4, 1, "fused")], timeout=400)


def _expect_config_error(fn, *starts):
    from fsdp_turbo.config_check import ConfigError

    with pytest.raises(ConfigError) as caught:
        fn()
    problems = caught.value.problems
    assert len(problems) == len(starts) and all(p.startswith(s) for p, s in zip(problems, starts)), problems


def _with(config, recompute_plan=None, module_patches=None):
    if recompute_plan is not None:
        config.memory.recompute, config.memory.recompute_plan = True, recompute_plan
    if module_patches is not None:
        config.module_patches = module_patches
    return config


def _state_rank_fn(rank, world):
    from torch.distributed.device_mesh import DeviceMesh

    from fsdp_turbo.distributed import parallel_state
    from fsdp_turbo.fsdp_turbo import FSDPTurbo
    from fsdp_turbo.fsdp_turbo_config import DistributedConfig, EPPlanConfig, FSDPTurboConfig
    from fsdp_turbo.training.clip_grads import clip_grad_norm

    def config(fsdp=2, ep=2, efsdp=1, **fields):
        return FSDPTurboConfig(distributed=DistributedConfig(
            fully_shard_parallel_size=fsdp, expert_parallel_size=ep, expert_fully_shard_parallel_size=efsdp,
            ep_plan=EPPlanConfig(apply_modules=[EXPERTS]), **fields))

    with pytest.raises(RuntimeError, match="not initialised"):
        parallel_state.get_parallel_state()
    _expect_config_error(lambda: parallel_state.init_parallel_state(config(fsdp=3)),
                         "distributed.fully_shard_parallel_size: 3 does not divide the world size 4; accepted: 1, 2, 4")
    _expect_config_error(lambda: parallel_state.init_parallel_state(config(ep=3)),
                         "distributed.expert_parallel_size (3, ep_size) and expert_fully_shard_parallel_size (1, "
                         "efsdp_size) on 4 ranks: dp_size must be divisible by ep_size")
    _expect_config_error(lambda: parallel_state.init_parallel_state(config(data_parallel_size=4)),
                         "distributed.data_parallel_size: 4, but on 4 ranks it is 2; accepted: 2 or None")

    state = parallel_state.init_parallel_state(config())
    assert parallel_state.init_parallel_state(config()) is state is parallel_state.get_parallel_state()
    with pytest.raises(RuntimeError, match="already initialised"):
        parallel_state.init_parallel_state(config(ep=4))
    # EP alone: every rank takes its own samples; no context parallelism
    assert (state.get_data_group_size(), state.get_data_rank()) == (world, rank)
    assert dist.get_process_group_ranks(state.get_data_group()) == list(range(world))
    assert not state.is_group_enable("ulysses") and not state.is_group_enable("no_such_mesh")
    assert state.get_ulysses_group_size() == 1 and state.get_ulysses_rank() == 0
    assert dist.get_world_size(state.get_ulysses_group()) == 1
    assert state.is_group_enable("ep") and state.is_ep_enable() and not state.is_efsdp_enable()
    assert (state.get_ep_group_size(), state.get_ep_rank()) == (2, rank % 2)
    assert state.get_dp_fsdp_group_size() == [2, 2] and state.get_dp_fsdp_rank() == [rank // 2, rank % 2]
    assert state.get_edp_efsdp_group_size() == [2, 1]
    assert isinstance(state.get_dp_fsdp_device_mesh(), DeviceMesh)
    with pytest.raises(AttributeError, match="get_<name>_group"):
        state.get_kvallgather_group()

    model = build_model("qwen3_moe")
    _expect_config_error(lambda: FSDPTurbo(_with(config(), recompute_plan=["nope"]), model),
                         "memory.recompute_plan: 'nope' matches no module of Qwen3MoeForCausalLM")
    bad_patch = _with(config(), module_patches=[{"target": "torch.nn.Conv2d.forward",
                                                 "replacement": "torch.nn.functional.relu"}])
    _expect_config_error(lambda: FSDPTurbo(bad_patch, build_model("qwen3_moe")),
                         "module_patches[0]: target 'torch.nn.Conv2d.forward' is neither a module-level callable")
    one_unmatched = config()
    one_unmatched.distributed.ep_plan.apply_modules = [EXPERTS, "model.no_such.experts"]
    _expect_config_error(lambda: FSDPTurbo(one_unmatched, build_model("qwen3_moe")),
                         "distributed.ep_plan.apply_modules: 'model.no_such.experts' matches no module")
    unknown = config()
    unknown.distributed.fsdp_plan.ignored_params = ["model.no_such.weight"]
    _expect_config_error(lambda: FSDPTurbo(unknown, build_model("qwen3_moe")),
                         "distributed.fsdp_plan.ignored_params: ['model.no_such.weight'] are no parameters")

    wrapper = FSDPTurbo(config(), build_model("qwen3_moe"))
    ids = batch(0, world)
    wrapper(input_ids=ids[rank:rank + 1], labels=ids[rank:rank + 1]).loss.backward()
    with pytest.raises(ValueError, match="accepted: None"):
        clip_grad_norm(model=wrapper, max_norm=1.0, group=dist.group.WORLD)
    assert clip_grad_norm(model=wrapper.model, max_norm=float("inf")) > 0
    parallel_state.reset_parallel_state()
    with pytest.raises(RuntimeError, match="not initialised"):
        parallel_state.get_parallel_state()


def test_parallel_state_and_the_errors_that_need_a_world_or_a_model():
    run_ranks(_state_rank_fn, 4, timeout=300)


def _bf16_rank_fn(rank, world, layouts):
    from fsdp_turbo.distributed.parallel_state import reset_parallel_state
    from fsdp_turbo.fsdp_turbo import FSDPTurbo
    from fsdp_turbo.fsdp_turbo_config import DistributedConfig, EPPlanConfig, FSDPPlanConfig, FSDPTurboConfig

    for fsdp, ep, efsdp in layouts:
        where = f"fsdp {fsdp} ep {ep} efsdp {efsdp}"
        config = FSDPTurboConfig(distributed=DistributedConfig(
            fully_shard_parallel_size=fsdp, expert_parallel_size=ep, expert_fully_shard_parallel_size=efsdp,
            fsdp_plan=FSDPPlanConfig(apply_modules={"model.layers.{*}": {}, "lm_head": {}}, param_dtype="bf16",
                                     reduce_dtype="fp32", output_dtype="bf16"),
            ep_plan=EPPlanConfig(apply_modules=[EXPERTS])))
        wrapper = FSDPTurbo(config, build_model("qwen3_moe"))
        seen = {}

        def record(name):
            def hook(module, args):
                seen[name] = {n: p.dtype for n, p in module.named_parameters(recurse=False)}
            return hook

        layer = wrapper.model.model.layers[0]
        hooks = [layer.self_attn.q_proj.register_forward_pre_hook(record("q_proj")),
                 layer.mlp.experts.register_forward_pre_hook(record("experts"))]
        ids = batch(0, world)
        out = wrapper(input_ids=ids[rank:rank + 1], labels=ids[rank:rank + 1])
        out.loss.backward()
        for hook in hooks:
            hook.remove()
        assert out.logits.dtype == torch.bfloat16, (where, out.logits.dtype)
        assert seen["q_proj"] == {"weight": torch.bfloat16}, (where, seen)
        assert set(seen["experts"].values()) == {torch.bfloat16}, (where, seen)
        grads = {n: p.grad.dtype for n, p in wrapper.model.named_parameters() if p.grad is not None}
        assert set(grads.values()) == {torch.float32} and len(grads) == len(list(wrapper.model.parameters())), \
            (where, grads)
        reset_parallel_state()


def test_bf16_mixed_precision_reaches_every_unit():
    """`param_dtype` / `output_dtype` bf16 (as verl's GPU recipes write them): attention and the
    experts compute in bf16 (expert FSDP or not), the logits come out in bf16, and every
    gradient lands in the fp32 parameters."""
    run_ranks(_bf16_rank_fn, 4, [(4, 2, 2), (2, 4, 1)], timeout=300)
