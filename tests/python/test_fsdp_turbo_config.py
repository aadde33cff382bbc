"""FSDPTurbo's configuration (`fsdp_turbo.fsdp_turbo_config`) in one process: what
`_dict_to_dataclass` builds from verl's plain dict, what `__post_init__` derives, every problem
reported at once with its path, what is not built; and the module patches
(`fsdpturbo.patch.apply_module_patch`)."""
import logging
import types

import pytest
import torch

from fsdp_turbo.config_check import ConfigError
from fsdp_turbo.fsdp_turbo_config import (CPPlanConfig, DistributedConfig, EPPlanConfig, FSDPPlanConfig,
                                          FSDPTurboConfig, MemoryConfig, QuantizationConfig, _dict_to_dataclass)

EXPERTS = "model.layers.{*}.mlp.experts"


def test_empty_dict_is_the_default_config():
    config = _dict_to_dataclass(FSDPTurboConfig, {})
    assert config == FSDPTurboConfig()
    assert config.distributed.fsdp_plan == FSDPPlanConfig()
    assert config.distributed.ep_plan.dispatcher == "eager" and config.distributed.ep_plan.apply_modules == []
    assert config.distributed.tp_plan.colwise_parallel == [] and config.memory.recompute_plan == []


def test_nested_sections_recurse_and_list_entries_stay_dicts():
    patches = [{"target": "a.b.f", "replacement": "c.d.g"}]
    cp = {"ulysses_function_patches": [], "loss_function_patches": []}
    config = _dict_to_dataclass(FSDPTurboConfig, types.MappingProxyType({
        "module_patches": patches,
        "distributed": {"fully_shard_parallel_size": 4, "cp_plan": cp,
                        "fsdp_plan": {"apply_modules": {"model.layers.{*}": {}}, "param_dtype": "bf16"}},
        "memory": {"recompute": True, "recompute_plan": ["model.layers.{*}"]}}))
    assert config.module_patches == patches and type(config.module_patches[0]) is dict
    assert isinstance(config.distributed, DistributedConfig) and isinstance(config.distributed.cp_plan, CPPlanConfig)
    assert isinstance(config.distributed.fsdp_plan, FSDPPlanConfig)
    assert config.distributed.fsdp_plan.apply_modules == {"model.layers.{*}": {}}
    assert isinstance(config.memory, MemoryConfig) and config.memory.recompute


def test_unknown_keys_warn_and_are_skipped(caplog):
    with caplog.at_level(logging.WARNING, logger="fsdp_turbo.fsdp_turbo_config"):
        config = _dict_to_dataclass(FSDPTurboConfig, {"bogus": 1, "distributed": {"kv_allgather_parallel_size": 2}})
    assert config == FSDPTurboConfig()
    messages = [r.getMessage() for r in caplog.records]
    assert any("FSDPTurboConfig has no field 'bogus'" in m for m in messages)
    assert any("FSDPTurboConfig.distributed has no field 'kv_allgather_parallel_size'" in m for m in messages)


def test_strings_become_numbers_and_dtypes_where_the_field_says_so(caplog):
    config = _dict_to_dataclass(FSDPTurboConfig, {"distributed": {"fully_shard_parallel_size": "2"},
                                                  "optimizer": {"lr": "3e-4"}, "model": {"torch_dtype": "torch.float32"},
                                                  "checkpoint": {"output_dir": "123"}})
    assert config.distributed.fully_shard_parallel_size == 2 and config.optimizer.lr == 3e-4
    assert config.model.torch_dtype is torch.float32 and config.checkpoint.output_dir == "123"
    with caplog.at_level(logging.WARNING, logger="fsdp_turbo.fsdp_turbo_config"):
        config = _dict_to_dataclass(FSDPTurboConfig, {"model": {"torch_dtype": "float99"}})
    assert config.model.torch_dtype == "float99"
    assert any("FSDPTurboConfig.model.torch_dtype is 'float99', which is not a dtype" in r.getMessage()
               for r in caplog.records)


def test_none_and_non_mappings_pass_through():
    assert _dict_to_dataclass(FSDPTurboConfig, None) is None
    config = FSDPTurboConfig()
    assert _dict_to_dataclass(FSDPTurboConfig, config) is config


def test_the_originals_ep_derivations():
    config = FSDPTurboConfig(distributed=DistributedConfig(
        fully_shard_parallel_size=2, expert_parallel_size=2,
        fsdp_plan=FSDPPlanConfig(ignored_modules=["model.embed_tokens", EXPERTS]),
        ep_plan=EPPlanConfig(apply_modules=[EXPERTS], dispatcher=None)))
    plan = config.distributed.ep_plan
    assert plan.dispatcher == "eager" and plan.apply_efsdp_modules == ["model.layers.{*}.mlp"]
    assert config.distributed.fsdp_plan.ignored_modules == ["model.embed_tokens", EXPERTS]  # joined once
    swift = EPPlanConfig(apply_modules=[EXPERTS], apply_efsdp_modules=[EXPERTS], dispatcher="fused")
    config = FSDPTurboConfig(distributed=DistributedConfig(expert_parallel_size=2, ep_plan=swift))
    assert swift.apply_efsdp_modules == [EXPERTS] and config.distributed.fsdp_plan.ignored_modules == []


def test_llamafactory_plugin_plans_keep_working():
    """LlamaFactory's plugin imports both plans from here and builds them with its keywords."""
    import fsdpturbo.efsdp
    import fsdpturbo.ep
    from fsdp_turbo import fsdp_turbo_config

    assert fsdp_turbo_config.EPPlanConfig is fsdpturbo.ep.EPPlanConfig
    plan = fsdp_turbo_config.FSDPPlanConfig(apply_modules={}, hook_modules=[], fsdp_implementation="native")
    assert isinstance(plan, fsdpturbo.efsdp.FSDPPlanConfig)
    ep_plan = fsdp_turbo_config.EPPlanConfig(apply_modules=[EXPERTS], dispatcher="eager",
                                             apply_efsdp_modules=["model.layers.{*}.mlp"])
    ep_plan.gradient_divide_factor = 4.0


def test_every_problem_is_reported_at_once_with_its_path():
    with pytest.raises(ConfigError) as caught:
        _dict_to_dataclass(FSDPTurboConfig, {
            "distributed": {"fully_shard_parallel_size": 0, "expert_parallel_size": 0,
                            "ep_plan": {"dispatcher": "moonep"},
                            "fsdp_plan": {"param_dtype": "fp8", "hook_modules": "model", "num_to_forward_prefetch": -1,
                                          "apply_modules": {"model.layers.{*}": {"mesh": None}}}},
            "memory": {"recompute": True},
            "module_patches": [{"target": "a.b"}]})
    problems = caught.value.problems
    expected = ["distributed.fully_shard_parallel_size: expected a positive integer, got 0",
                "distributed.expert_parallel_size: ep_size must be positive, got 0.",
                "distributed.ep_plan.dispatcher: Unsupported dispatcher moonep. Supported: ['domino', 'eager', 'fused',",
                "distributed.fsdp_plan.hook_modules: expected a list of strings",
                "distributed.fsdp_plan.param_dtype: FSDPPlanConfig.param_dtype is 'fp8'; accepted: ['bf16',",
                "distributed.fsdp_plan.num_to_forward_prefetch: expected an integer >= 0, got -1",
                "distributed.fsdp_plan.apply_modules['model.layers.{*}']: expected a pattern -> a mapping of fully_shard",
                "memory.recompute_plan: empty while memory.recompute is True",
                "module_patches[0]: expected {'target': dotted path, 'replacement'"]
    for start in expected:
        assert sum(p.startswith(start) for p in problems) == 1, (start, problems)
    assert len(problems) == len(expected), problems
    assert str(caught.value).startswith(f"FSDPTurboConfig has {len(expected)} problems:\n  ")


@pytest.mark.parametrize("fields, problem", [
    (dict(distributed=DistributedConfig(tensor_parallel_size=2)),
     "distributed.tensor_parallel_size: 2, but tensor parallelism is not built in fsdpturbo; accepted: 1"),
    (dict(distributed=DistributedConfig(ulysses_parallel_size=0)),
     "distributed.ulysses_parallel_size: cp_size must be positive, got 0. Accepted: a positive integer."),
    (dict(distributed=DistributedConfig(ulysses_parallel_size=None)),
     "distributed.ulysses_parallel_size: expected a positive integer, got null"),
    (dict(distributed=DistributedConfig(fsdp_plan=FSDPPlanConfig(reshard_after_forward=1))),
     "distributed.fsdp_plan.reshard_after_forward: expected a boolean (true or false), got integer 1"),
    (dict(distributed=DistributedConfig(fsdp_plan=FSDPPlanConfig(cpu_offload="false"))),
     "distributed.fsdp_plan.cpu_offload: expected a boolean, got 'false' (a string is not converted)"),
    (dict(distributed=DistributedConfig(expert_parallel_size="2")),
     "distributed.expert_parallel_size: expected a positive integer, got '2' (a string is not converted)"),
    (dict(distributed=DistributedConfig(cp_plan=CPPlanConfig(ulysses_function_patches=[
        {"target_functions": ["transformers.integrations.sdpa_attention.sdpa_attention_forward"],
         "type": "ring_attention"}]))),
     "distributed.cp_plan.ulysses_function_patches[0].type: 'ring_attention' is no ulysses_function_patches type; "
     "accepted: full_attention, gated_delta_net"),
    (dict(distributed=DistributedConfig(cp_plan=CPPlanConfig(loss_function_patches=[
        {"target_functions": ["transformers.loss.loss_utils.ForCausalLMLoss"], "type": "full_attention"}]))),
     "distributed.cp_plan.loss_function_patches[0].type: 'full_attention' is no loss_function_patches type; "
     "accepted: causal_lm_loss"),
    (dict(distributed=DistributedConfig(cp_plan=CPPlanConfig(loss_function_patches=[
        {"target": "transformers.loss.loss_utils.ForCausalLMLoss", "type": "causal_lm_loss"}]))),
     "distributed.cp_plan.loss_function_patches[0]: expected {'target_functions': [dotted paths], 'type': name}"),
    (dict(distributed=DistributedConfig(cp_plan=CPPlanConfig(ulysses_function_patches=[
        {"target_functions": [], "type": "gated_delta_net"}]))),
     "distributed.cp_plan.ulysses_function_patches[0].target_functions: expected a non-empty list of dotted paths"),
    (dict(distributed=DistributedConfig(fsdp_plan=FSDPPlanConfig(fsdp_implementation="custom"))),
     "distributed.fsdp_plan.fsdp_implementation: 'custom' (FSDPTurbo's fine-grained fully_shard) is not built"),
    (dict(memory=MemoryConfig(chunk_batch=True)), "memory.chunk_batch: chunked batches are not built"),
    (dict(quantization=QuantizationConfig(quantization_plan={"quant_recipe": "mxfp8"})),
     "quantization.quantization_plan: {'quant_recipe': 'mxfp8'}, but quantisation is not built"),
    (dict(distributed=DistributedConfig(expert_parallel_size=2)),
     "distributed.ep_plan.apply_modules: empty, but expert_parallel_size is 2"),
    (dict(module_patches=[{"target": "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeModel.forward",
                           "replacement": "fsdp_turbo.models.qwen.qwen3_5_moe.qwen3_5_moe_model_forward"}]),
     "module_patches[0].replacement: 'fsdp_turbo.models.qwen.qwen3_5_moe.qwen3_5_moe_model_forward': FSDPTurbo's "
     "model forwards (fsdp_turbo.models.*"),
])
def test_what_is_not_built_or_cannot_work_is_an_error(fields, problem):
    with pytest.raises(ConfigError) as caught:
        FSDPTurboConfig(**fields)
    assert len(caught.value.problems) == 1 and caught.value.problems[0].startswith(problem), caught.value.problems


def test_tp_plan_and_empty_cp_plan_are_accepted_without_tp_and_cp():
    """The ms-swift fork passes its model spec's TP modules with tp_size 1 and empty CP patches."""
    from fsdp_turbo.fsdp_turbo_config import TPPlanConfig

    FSDPTurboConfig(distributed=DistributedConfig(tp_plan=TPPlanConfig(colwise_parallel=["model.layers.{*}.q_proj"]),
                                                  cp_plan=CPPlanConfig([], [])))


def test_base_trainer_is_not_built():
    with pytest.raises(ImportError, match="BaseTrainer .* is not built"):
        import fsdp_turbo.training.trainer  # noqa: F401


def test_set_log_level_sets_the_package_loggers():
    from fsdp_turbo.utils.log import set_log_level

    before = {name: logging.getLogger(name).level for name in ("fsdpturbo", "fsdp_turbo")}
    try:
        set_log_level("info")
        assert logging.getLogger("fsdpturbo.engine").getEffectiveLevel() == logging.INFO
        assert logging.getLogger("fsdp_turbo").level == logging.INFO
        set_log_level(logging.DEBUG)
        assert logging.getLogger("fsdpturbo").level == logging.DEBUG
        for bad in ("LOUD", -1, True, None):
            with pytest.raises(ValueError, match=r"level .*; accepted: one of \['DEBUG'"):
                set_log_level(bad)
    finally:
        for name, level in before.items():
            logging.getLogger(name).setLevel(level)


# ---------------------------------------------------------------------------------------------
# Module patches
# ---------------------------------------------------------------------------------------------

def _doubled(x):
    return 2 * x


def test_module_level_targets_are_replaced_with_their_aliases_once():
    import sys

    from fsdpturbo.patch import apply_module_patch

    owner = types.ModuleType("ft_patch_owner")
    owner.f = lambda x: x
    alias = types.ModuleType("ft_patch_alias")
    alias.g = owner.f  # `from ft_patch_owner import f as g`
    sys.modules.update(ft_patch_owner=owner, ft_patch_alias=alias)
    try:
        wrapped = []

        def wrap(x):
            wrapped.append(x)
            return _doubled(x)

        assert apply_module_patch(torch.nn.Linear(1, 1), "ft_patch_owner.f", wrap) == 1
        assert apply_module_patch(torch.nn.Linear(1, 1), "ft_patch_owner.f", wrap) == 1  # a second engine
        assert owner.f is wrap and alias.g is wrap
        assert owner.f(3) == 6 and wrapped == [3]
    finally:
        del sys.modules["ft_patch_owner"], sys.modules["ft_patch_alias"]


def test_class_member_targets_count_the_matching_modules():
    from fsdpturbo.patch import apply_module_patch

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
    assert apply_module_patch(model, "torch.nn.Linear.extra_repr", lambda self: "patched") == 2
    assert "patched" in repr(model)
    assert apply_module_patch(model, "torch.nn.Conv2d.forward", _doubled) == 0  # FSDPTurbo refuses it
