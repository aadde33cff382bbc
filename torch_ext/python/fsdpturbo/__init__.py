"""libfsdpturbo for PyTorch: the expert-parallel and expert-FSDP engine's Python API.

Every rule, number and plan comes from the Rust core (through its C ABI); this package does
what must be Python: torch DeviceMeshes, DTensors and torch.distributed calls.
"""
from ._native import FsdpturboError, FsdpturboValueError, ops
from .config import parse_train_config
from .norm import clip_grad_norm_, get_total_norm, warmup_grad_norm
from .pattern import module_name_match
from .placement import copy_weights_, gather_full, local_shape_and_offset
from .topology import ParallelState, get_parallel_state, initialize_parallel_state, reset_parallel_state

__version__ = ops.version()

__all__ = [
    "FsdpturboError", "FsdpturboValueError", "ParallelState", "clip_grad_norm_", "copy_weights_", "gather_full",
    "get_parallel_state", "get_total_norm", "initialize_parallel_state", "local_shape_and_offset",
    "module_name_match", "ops", "parse_train_config", "reset_parallel_state", "warmup_grad_norm",
]
