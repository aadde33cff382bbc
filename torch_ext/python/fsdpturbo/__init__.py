"""libfsdpturbo for PyTorch: the expert-parallel and expert-FSDP engine's Python API.

Every rule, number and plan comes from the Rust core (through its C ABI); this package does
what must be Python: torch DeviceMeshes, DTensors and torch.distributed calls.
"""
from . import moe_ops
from ._native import FsdpturboError, FsdpturboValueError, host_isa, ops
from .adapters import load_lora_adapter, save_lora_adapter, save_merged_weights
from .balance import balance_step
from .checkpoint import load_checkpoint, save_checkpoint
from .config import parse_train_config
from .efsdp import FSDPPlanConfig, expert_fully_shard_modules
from .engine import shard_model
from .expert_bias import update_expert_bias
from .expert_stats import expert_load, expert_load_table, load_summary
from .norm import clip_grad_norm_, get_total_norm, warmup_grad_norm
from .patch import patch_model_members
from .router_replay import record_routes, replay_routes
from .pattern import module_name_match
from .placement import copy_weights_, gather_full, local_shape_and_offset
from .plan import get_model_spec, register_model_spec, resolve_plan
from .registry import dispatch_op, get_op, register_op
from .topology import ParallelState, get_parallel_state, initialize_parallel_state, reset_parallel_state
from .weights import full_state_dict, load_hf_weights, meta_parameters, save_hf_weights

moe_ops.register()  # the MoE ops' autograd and fake kernels (explicitly, not by import order)
__version__ = ops.version()

__all__ = [
    "FSDPPlanConfig", "FsdpturboError", "FsdpturboValueError", "ParallelState", "balance_step", "clip_grad_norm_",
    "copy_weights_",
    "dispatch_op", "expert_fully_shard_modules", "expert_load", "expert_load_table", "full_state_dict", "gather_full", "get_model_spec", "get_op", "get_parallel_state",
    "get_total_norm", "host_isa", "initialize_parallel_state", "load_checkpoint", "load_lora_adapter", "load_summary", "load_hf_weights", "local_shape_and_offset", "meta_parameters",
    "module_name_match", "ops", "parse_train_config", "patch_model_members", "record_routes", "replay_routes", "register_model_spec", "register_op", "reset_parallel_state", "resolve_plan",
    "save_checkpoint", "save_hf_weights", "save_lora_adapter", "save_merged_weights", "shard_model", "update_expert_bias", "warmup_grad_norm",
]
