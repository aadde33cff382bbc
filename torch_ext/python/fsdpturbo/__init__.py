"""libfsdpturbo for PyTorch: the expert-parallel and expert-FSDP engine's Python API.

Every rule, number and plan comes from the Rust core (through its C ABI); this package does
what must be Python: torch DeviceMeshes, DTensors and torch.distributed calls.
"""
from ._native import FSDPTurboError, FSDPTurboValueError, host_isa, ops
from .adapters import load_lora_adapter, save_lora_adapter, save_merged_weights
from .checkpoint import load_checkpoint, save_checkpoint
from .config import parse_train_config
from .efsdp import FSDPPlanConfig, expert_fully_shard_modules
from .engine import shard_model
from .ep import EPPlanConfig, expert_parallelize_modules
from .moe.balance import balance_step
from .moe.expert_bias import update_expert_bias
from .moe.expert_stats import expert_load, expert_load_summary, expert_load_table, load_summary
from .moe.ops import register as _register_moe_ops
from .moe.router_replay import record_routes, replay_routes
from .norm import clip_grad_norm_, get_total_norm, warmup_grad_norm
from .patch import patch_model_members
from .pattern import module_name_match
from .placement import copy_weights_, gather_full, local_shape_and_offset
from .plan import resolve_plan
from .registry import dispatch_op, get_op, register_op
from .spec import get_model_spec, register_model_spec
from .topology import ParallelState, get_parallel_state, initialize_parallel_state, reset_parallel_state
from .weights import full_state_dict, load_hf_weights, meta_parameters, save_hf_weights

_register_moe_ops()  # the MoE ops' autograd and fakes (explicitly, not by import order)
__version__ = ops.version()

__all__ = [
    # errors and the op library
    "FSDPTurboError",
    "FSDPTurboValueError",
    "host_isa",
    "ops",
    # configuration, topology and plan
    "ParallelState",
    "get_model_spec",
    "get_parallel_state",
    "initialize_parallel_state",
    "module_name_match",
    "parse_train_config",
    "register_model_spec",
    "reset_parallel_state",
    "resolve_plan",
    # sharding
    "EPPlanConfig",
    "FSDPPlanConfig",
    "expert_fully_shard_modules",
    "expert_parallelize_modules",
    "patch_model_members",
    "shard_model",
    # weights, checkpoints and adapters
    "copy_weights_",
    "full_state_dict",
    "gather_full",
    "load_checkpoint",
    "load_hf_weights",
    "load_lora_adapter",
    "local_shape_and_offset",
    "meta_parameters",
    "save_checkpoint",
    "save_hf_weights",
    "save_lora_adapter",
    "save_merged_weights",
    # training steps
    "balance_step",
    "clip_grad_norm_",
    "get_total_norm",
    "update_expert_bias",
    "warmup_grad_norm",
    # routing: statistics and replay
    "expert_load",
    "expert_load_summary",
    "expert_load_table",
    "load_summary",
    "record_routes",
    "replay_routes",
    # the operator registry
    "dispatch_op",
    "get_op",
    "register_op",
]
