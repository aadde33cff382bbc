"""Applying `kernel_config` to a model (as the seed and LlamaFactory define it, docs/kernels.md): the
flash-linear-attention kernels installed on every module that has the HF attribute.

`apply_kernels(model, kernel_config, device_type=None)` validates the configuration with the
Rust core (the seed's errors: name, include_kernels, chunk_size) and applies the names in the
order written:

* `"flash-linear-attention"` (`apply_flash_linear_attention`): the device must be CUDA or NPU
  and `fla` importable; for each selected kernel, the operator from the registry (the chunk
  kernel bound to `chunk_size` with `functools.partial`) replaces the attribute
  `chunk_gated_delta_rule` / `recurrent_gated_delta_rule` of every module class that has it
  (`patch_model_members`); a kernel that matches nothing is a RuntimeError.
* `"auto"`: the seed applies LlamaFactory's NPU fused kernels (MoE, RMSNorm, RoPE, SwiGLU)
  there; this library has none of them, so it applies nothing (and says so in the log). The
  experts' forward is replaced by the EP dispatcher anyway.
"""
import functools
import logging

from . import fla
from .config import parse_train_config
from .patch import patch_model_members
from .registry import current_device_type, get_op

logger = logging.getLogger(__name__)

__all__ = ["FLA_MODEL_ATTRIBUTES", "apply_flash_linear_attention", "apply_kernels"]

# Kernel name -> the model attribute (HF's linear-attention layers) it replaces, in "auto" order.
FLA_MODEL_ATTRIBUTES = {
    "chunk_gated_delta_rule": "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule": "recurrent_gated_delta_rule",
}


def _kernel_config(kernel_config):
    if not isinstance(kernel_config, dict):
        raise TypeError(f"kernel_config must be a dict (the YAML mapping), got {type(kernel_config).__name__}")
    return parse_train_config({"kernel_config": kernel_config})["kernel"]


def apply_kernels(model, kernel_config, device_type=None):
    """Applies the kernels named by `kernel_config` (a dict as in the training YAML) to `model`
    in the order written and returns the model."""
    config = _kernel_config(kernel_config)
    for name in config["names"]:
        if name == "flash-linear-attention":
            apply_flash_linear_attention(model, config["include_kernels"], config["chunk_size"], device_type)
        else:
            logger.info("kernel_config name 'auto': libfsdpturbo has no automatic kernels for device '%s'; "
                        "nothing applied.", device_type or current_device_type())
    return model


def _check_fla_available():
    try:
        fla.load_fla_kernel("chunk_gated_delta_rule")
    except ImportError as e:
        raise RuntimeError(f"Flash Linear Attention and FSDPTurbo are required for this kernel. {e}") from e


def apply_flash_linear_attention(model, include_kernels="auto", chunk_size=64, device_type=None):
    """Installs the selected FLA kernels ("auto" or a list of kernel names, validated as in
    `kernel_config`) on `model`; returns the number of module callables replaced."""
    include = include_kernels
    if isinstance(include, (list, tuple)):
        include = ", ".join(include)
    config = _kernel_config({"name": "flash-linear-attention", "include_kernels": include,
                             "chunk_size": chunk_size})
    selected = list(FLA_MODEL_ATTRIBUTES) if config["include_kernels"] == "auto" else config["include_kernels"]
    device_type = device_type or current_device_type()
    if device_type not in fla.FLA_DEVICE_TYPES:
        raise RuntimeError(f"FlashLinearAttentionKernel requires CUDA or NPU, current accelerator is {device_type}.")
    _check_fla_available()
    if model is None:
        raise ValueError("HFModel instance is required for FlashLinearAttentionKernel.")
    patched = 0
    for op_name in selected:
        op = get_op(op_name, device_type)
        if op_name == "chunk_gated_delta_rule":
            op = functools.partial(op, chunk_size=config["chunk_size"])
        attr = FLA_MODEL_ATTRIBUTES[op_name]
        targets = sorted({f"{type(m).__module__}.{type(m).__name__}.{attr}"
                          for _, m in model.named_modules() if callable(getattr(m, attr, None))})
        matched = patch_model_members(model, targets, op) if targets else 0
        if matched == 0:
            raise RuntimeError(f"FLA operator `{op_name}` did not match any model module attributes.")
        patched += matched
    logger.info("Flash Linear Attention kernels updated %d module callables: %s.", patched, selected)
    return patched
