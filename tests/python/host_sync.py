"""A detector of host syncs for CPU tests: on a GPU, reading a tensor's value on the host waits
for the device (and breaks CUDA-graph capture); on CPU it costs nothing, so it must be caught
by what is called, not by its cost.

`no_host_sync()` raises `HostSync` at the first Python-level read of a tensor's value
(`item`, `tolist`, `cpu`, `numpy`, `bool(t)`, `int(t)`, `float(t)`, `t.__index__`) and at the
first aten op that reads values on the host or whose output shape depends on values
(`_local_scalar_dense`, `nonzero`, `masked_select`, `unique`, `bincount`, `repeat_interleave`
without `output_size`, …), in forward and in backward (autograd runs CPU backward on this
thread, where both modes are active).
"""
import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
          torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}
_DATA_DEPENDENT = {"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "unique", "_unique",
                   "_unique2", "unique_consecutive", "unique_dim", "bincount", "histc", "argwhere"}


class HostSync(AssertionError):
    pass


class _Reads(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READS:
            raise HostSync(f"host read: Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))


class _DataDependentOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        sized_by_values = name == "repeat_interleave" and func._overloadname != "self_int" and \
            (kwargs or {}).get("output_size") is None
        if name in _DATA_DEPENDENT or sized_by_values:
            raise HostSync(f"data-dependent op: {func}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_sync():
    with _Reads(), _DataDependentOps():
        yield
