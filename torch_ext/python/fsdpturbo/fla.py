"""The flash-linear-attention kernel plugin (the seed's `fsdp_turbo.ops.fla`): the gated
delta rule kernels of the `fla` package (flash-linear-attention), registered in the operator
registry for "cuda" and "npu" as `chunk_gated_delta_rule` and
`fused_recurrent_gated_delta_rule`.

Both take the arguments of the `fla.ops.gated_delta_rule` function of the same name (HF's
Qwen3-Next / Qwen3.5 linear-attention layers call them through `self.chunk_gated_delta_rule`
and `self.recurrent_gated_delta_rule`) and pass them through unchanged. The chunk kernel also
takes `chunk_size` (16, 32 or 64; default 64), which the kernel plugin binds with
`functools.partial(op, chunk_size=...)`: it is passed on when the installed `fla` function has
a `chunk_size` parameter; FLA's CUDA kernels have none and always use chunks of 64, so there
any other value is a ValueError rather than silently ignored.

`fla` is imported when a kernel is called, not when this module is imported, so the operators
resolve on any host; calling one without `fla` raises an ImportError that names the package.

The functions' `__module__` is "fsdp_turbo.ops.fla", their public home in the compatibility
package (LlamaFactory checks it); they are defined here, once, and re-exported there.
"""
import functools
import importlib
import inspect

from .config import parse_train_config
from .registry import register_op

__all__ = ["FLA_DEVICE_TYPES", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "load_fla_kernel"]

FLA_MODULE = "fla.ops.gated_delta_rule"
FLA_DEVICE_TYPES = ("cuda", "npu")
_PUBLIC_MODULE = "fsdp_turbo.ops.fla"
# FLA's chunked kernels use this chunk size and take no chunk_size argument.
_FLA_FIXED_CHUNK = 64


def load_fla_kernel(name):
    """`fla.ops.gated_delta_rule.<name>`, or an ImportError naming the package to install."""
    try:
        module = importlib.import_module(FLA_MODULE)
    except ImportError as e:
        raise ImportError(
            f"{_PUBLIC_MODULE}.{name} needs the flash-linear-attention package (import name `fla`, "
            f"`pip install flash-linear-attention`), but `import {FLA_MODULE}` failed: {e}", name="fla") from e
    try:
        return getattr(module, name)
    except AttributeError:
        raise ImportError(f"{_PUBLIC_MODULE}.{name}: the installed flash-linear-attention package has no "
                          f"{FLA_MODULE}.{name}", name=FLA_MODULE) from None


@functools.lru_cache(maxsize=None)
def _checked_chunk_size(chunk_size):
    # The accepted values are the kernel_config rule of the Rust core.
    return parse_train_config({"kernel_config": {"name": "flash-linear-attention",
                                                 "chunk_size": chunk_size}})["kernel"]["chunk_size"]


def _chunk_size(chunk_size):
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise ValueError(f"chunk_size must be one of (16, 32, 64), got {chunk_size!r}.")
    return _checked_chunk_size(chunk_size)


@functools.lru_cache(maxsize=None)
def _takes_chunk_size(fn):
    try:
        return "chunk_size" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature (a builtin): pass nothing extra
        return False


def chunk_gated_delta_rule(*args, chunk_size=_FLA_FIXED_CHUNK, **kwargs):
    """`fla.ops.gated_delta_rule.chunk_gated_delta_rule(*args, **kwargs)` with the plugin's
    `chunk_size` (see the module docstring)."""
    chunk_size = _chunk_size(chunk_size)
    kernel = load_fla_kernel("chunk_gated_delta_rule")
    if _takes_chunk_size(kernel):
        return kernel(*args, chunk_size=chunk_size, **kwargs)
    if chunk_size != _FLA_FIXED_CHUNK:
        raise ValueError(
            f"chunk_size={chunk_size} is not supported by the installed flash-linear-attention: its "
            f"{FLA_MODULE}.chunk_gated_delta_rule takes no chunk_size and uses chunks of {_FLA_FIXED_CHUNK}; "
            f"set kernel_config.chunk_size to {_FLA_FIXED_CHUNK} (the default)")
    return kernel(*args, **kwargs)


def fused_recurrent_gated_delta_rule(*args, **kwargs):
    """`fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule(*args, **kwargs)`."""
    return load_fla_kernel("fused_recurrent_gated_delta_rule")(*args, **kwargs)


for _fn in (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule):
    _fn.__module__ = _PUBLIC_MODULE
    for _device_type in FLA_DEVICE_TYPES:
        register_op(_fn.__name__, _device_type)(_fn)
