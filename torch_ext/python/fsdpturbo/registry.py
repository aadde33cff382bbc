"""The device-operator registry (the seed's `fsdp_turbo.ops.registry`), backed by the Rust
registry of libfsdpturbo: the library maps (operator name, device type) to an implementation
id with the seed's rules, and this module keeps only the id -> callable table.

* `register_op(op_name, device_type)` is a decorator that registers the function and returns it
  unchanged; registering the same pair again replaces it silently (as the seed does).
* `get_op(op_name, device_type=None)` returns the device's own implementation, else the "cpu"
  one with a warning logged once per (op, device) ("Operator '…' not available for device '…',
  falling back to CPU implementation"), else raises KeyError ("Operator '…' is not
  registered…" / "Operator '…' not available for device '…' and no CPU fallback exists…").
* `dispatch_op(op_name, *args, device_type=None, **kwargs)` calls it.

Device types are torch's `torch.device(...).type` strings ("cpu", "cuda", "npu", …); a
`torch.device` is accepted and its type used. A device with an index ("cuda:0") and malformed
names are a ValueError (the seed would silently fall back to CPU for "cuda:0"). Without a
device, the build's accelerator (`torch.accelerator.current_accelerator()`, which does not
initialise it, so a CUDA build on a host without a usable GPU resolves "cuda") is used, and
"cpu" when torch has none (the seed raises AttributeError there).

Operators registered from C or C++ through the same library have no Python callable; asking for
one here is a KeyError that says so.
"""
import ctypes
import json
import logging
import threading
from collections.abc import Mapping

import torch

from ._native import FSDPTurboKeyError, check, lib, string_out

logger = logging.getLogger(__name__)

__all__ = ["OperatorRegistryView", "current_device_type", "dispatch_op", "get_op", "register_op"]

_EXACT, _FALLBACK, _FALLBACK_WARN = 0, 1, 2

# Implementation id -> callable. The lock makes a registration (library call + table update)
# atomic with respect to lookups.
_IMPLS = {}
_LOCK = threading.Lock()


def _name(value, what):
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__} ({value!r})")
    if "\0" in value:  # C strings end there: the library would see a shorter name
        raise ValueError(f"{what} {value!r} contains a NUL character")
    return value


def _device(device_type):
    if isinstance(device_type, torch.device):
        return device_type.type
    return _name(device_type, "device_type")


def current_device_type():
    """The device type `get_op` resolves for when none is given: the type of torch's build
    accelerator (`torch.accelerator.current_accelerator()`, which does not initialise the device,
    so it is safe before fork and on hosts without a usable GPU), else "cpu"."""
    accelerator = torch.accelerator.current_accelerator()
    return "cpu" if accelerator is None else accelerator.type


def register_op(op_name, device_type):
    """Decorator: registers the function as the implementation of `op_name` on `device_type` and
    returns it unchanged. Names are checked by the library when the decorator is applied."""
    op_name, device_type = _name(op_name, "op_name"), _device(device_type)

    def decorator(fn):
        if not callable(fn):
            raise TypeError(f"register_op({op_name!r}, {device_type!r}) decorates a callable, got "
                            f"{type(fn).__name__}")
        impl, replaced = ctypes.c_uint64(0), ctypes.c_uint64(0)
        with _LOCK:
            check(lib.fsdpturbo_op_register(op_name.encode(), device_type.encode(), ctypes.byref(impl),
                                            ctypes.byref(replaced)))
            _IMPLS[impl.value] = fn
            _IMPLS.pop(replaced.value, None)
        return fn

    return decorator


def _callable(impl_id, op_name, device_type):
    fn = _IMPLS.get(impl_id)
    if fn is None:
        raise FSDPTurboKeyError(
            f"Operator '{op_name}' for device '{device_type}' was registered outside Python (implementation "
            f"id {impl_id}, through the C ABI) and has no Python callable", "NOT_FOUND")
    return fn


def get_op(op_name, device_type=None):
    """The implementation of `op_name` for `device_type` (default: `current_device_type()`), with
    the seed's CPU fallback (warned once per pair) and KeyError for a missing operator."""
    op_name = _name(op_name, "op_name")
    device_type = current_device_type() if device_type is None else _device(device_type)
    impl, how = ctypes.c_uint64(0), ctypes.c_int32(0)
    with _LOCK:
        check(lib.fsdpturbo_op_resolve(op_name.encode(), device_type.encode(), ctypes.byref(impl),
                                       ctypes.byref(how)))
        fn = _callable(impl.value, op_name, device_type)
    if how.value == _FALLBACK_WARN:
        logger.warning(string_out(lib.fsdpturbo_op_fallback_warning, op_name.encode(), device_type.encode()))
    return fn


def dispatch_op(op_name, *args, device_type=None, **kwargs):
    """`get_op(op_name, device_type)(*args, **kwargs)`."""
    return get_op(op_name, device_type)(*args, **kwargs)


class OperatorRegistryView(Mapping):
    """A read-only live view of the registry as the seed's `_OPERATOR_REGISTRY` dict:
    operator name -> {device type -> callable}. Operators registered only outside Python map
    to the devices that have a Python callable (possibly none)."""

    def _snapshot(self):
        table = json.loads(string_out(lib.fsdpturbo_op_table_json))
        with _LOCK:
            return {op: {dev: _IMPLS[i] for dev, i in devices.items() if i in _IMPLS}
                    for op, devices in table.items()}

    def __getitem__(self, op_name):
        return self._snapshot()[op_name]

    def __iter__(self):
        return iter(self._snapshot())

    def __len__(self):
        return len(self._snapshot())

    def __repr__(self):
        return f"OperatorRegistryView({self._snapshot()!r})"
