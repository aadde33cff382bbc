"""Loads the two native libraries: libfsdpturbo (the Rust core, called through its C ABI with
ctypes) and libfsdpturbo_torch (the `torch.ops.fsdpturbo` op library).

Each is found through an environment variable (FSDPTURBO_LIB, FSDPTURBO_TORCH_LIB), then in
the installed package (`fsdpturbo/lib/`), then in a build tree (`target/release`, `build/torch_ext`
next to this source tree). A missing library is an ImportError listing where it looked.
"""
import ctypes
import os
import pathlib

import torch

from . import _abi

_PACKAGE = pathlib.Path(__file__).resolve().parent
_REPO = _PACKAGE.parents[2]


def _find(env, installed, built):
    candidates = [pathlib.Path(os.environ[env])] if os.environ.get(env) else []
    candidates += [_PACKAGE / "lib" / installed, _REPO / built]
    for path in candidates:
        if path.is_file():
            return path
    searched = "\n  ".join(str(p) for p in candidates)
    raise ImportError(f"fsdpturbo: cannot find {installed}; searched:\n  {searched}\n"
                      f"Build it (scripts/setup.sh) or point {env} at it.")


# The wheel ships the core once, under its SONAME: the name the op library links it by.
LIB_PATH = _find("FSDPTURBO_LIB", "libfsdpturbo.so.0", "target/release/libfsdpturbo.so")
TORCH_LIB_PATH = _find("FSDPTURBO_TORCH_LIB", "libfsdpturbo_torch.so", "build/torch_ext/libfsdpturbo_torch.so")

lib = ctypes.CDLL(str(LIB_PATH))
_abi.bind(lib)  # every signature, from the headers (scripts/gen_ctypes.py)


def c_strings(items):
    """`items` as a `const char *const *` array (never zero-sized) and its length."""
    encoded = [s.encode() for s in items]
    return (ctypes.c_char_p * max(len(encoded), 1))(*encoded), len(encoded)


def wheel_library_dirs():
    """The `lib` folders of the installed NVIDIA wheels (`nvidia/*/lib`: NCCL, cuBLAS, NVRTC),
    which libfsdpturbo searches after its FSDPTURBO_*_PATH variables."""
    try:
        import nvidia
    except ImportError:
        return []
    roots = [pathlib.Path(p) for p in getattr(nvidia, "__path__", [])]
    return sorted({str(d) for root in roots for d in root.glob("*/lib") if d.is_dir()})


lib.fsdpturbo_add_library_dirs(*c_strings(wheel_library_dirs()))
torch.ops.load_library(str(TORCH_LIB_PATH))
ops = torch.ops.fsdpturbo  # autograd and fakes: fsdpturbo.moe.ops.register(), called by the package

# Status codes (enum fsdpturbo_status_t), by their names without FSDPTURBO_ERR_.
OK = _abi.FSDPTURBO_OK
BUFFER_TOO_SMALL = _abi.FSDPTURBO_ERR_BUFFER_TOO_SMALL
_STATUS = {code: name.removeprefix("FSDPTURBO_ERR_") for code, name in _abi.STATUS_NAMES.items() if code != OK}


class FSDPTurboError(RuntimeError):
    """A failure reported by libfsdpturbo; `status` is the FSDPTURBO_ERR_* name."""

    def __init__(self, message, status):
        super().__init__(message)
        self.status = status


class FSDPTurboValueError(FSDPTurboError, ValueError):
    """Bad input (configuration, topology sizes, arguments): also a ValueError, like the seed's."""


class FSDPTurboKeyError(FSDPTurboError, KeyError):
    """A registry has no entry for the name asked for: also a KeyError, like the seed's."""

    __str__ = RuntimeError.__str__


_EXCEPTION_OF_CLASS = {_abi.FSDPTURBO_STATUS_CLASS_BAD_INPUT: FSDPTurboValueError,
                       _abi.FSDPTURBO_STATUS_CLASS_NOT_FOUND: FSDPTurboKeyError}


def last_error():
    """The library's last error on this thread, whole (`buf.value` would stop at a NUL)."""
    n = lib.fsdpturbo_last_error(None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    n = min(n, lib.fsdpturbo_last_error(buf, n + 1))
    return buf.raw[:n].decode("utf-8", "replace")


def check(status):
    """Raises the library's last error for a non-zero status, as the class of its status says
    (fsdpturbo_status_class: the table the op library uses too)."""
    if status == OK:
        return
    cls = _EXCEPTION_OF_CLASS.get(lib.fsdpturbo_status_class(status), FSDPTurboError)
    raise cls(last_error(), _STATUS.get(status, str(status)))


def host_isa():
    """The instruction set of libfsdpturbo's host (CPU) kernels in this process: "portable",
    "avx2" or "avx512", the best this CPU and build have, capped by FSDPTURBO_HOST_ISA (read once
    per process). Every path gives the same bits. A FSDPTURBO_HOST_ISA that names no instruction
    set raises FSDPTurboValueError, one this host cannot run FSDPTurboError, as every host kernel
    (the CPU ops of torch.ops.fsdpturbo) then does."""
    name = ctypes.c_char_p()
    check(lib.fsdpturbo_host_isa(ctypes.byref(name)))
    return name.value.decode()


def string_out(fn, *args):
    """Calls a `(..., char *buf, size_t cap, size_t *out_len)` function: size, then text, again
    while the text grew in between (a registration on another thread)."""
    capacity = 0
    while True:
        buf = ctypes.create_string_buffer(capacity) if capacity else None
        needed = ctypes.c_size_t(0)
        status = fn(*args, buf, capacity, ctypes.byref(needed))
        if status == BUFFER_TOO_SMALL and needed.value > capacity:
            capacity = needed.value
            continue
        check(status)
        return buf.raw[:needed.value - 1].decode("utf-8")  # `needed` counts the NUL


def u64_view(fn, *args, capacity=64):
    """Calls a `(..., uint64_t *buf, size_t cap, size_t *out_len)` function, again while the
    buffer is too small; returns a memoryview of the values (no Python int until indexed)."""
    while True:
        buf = (ctypes.c_uint64 * max(capacity, 1))()
        n = ctypes.c_size_t(0)
        status = fn(*args, buf, capacity, ctypes.byref(n))
        if status == BUFFER_TOO_SMALL and n.value > capacity:
            capacity = n.value
            continue
        check(status)
        return memoryview(buf).cast("B").cast("Q")[: n.value]


def u64_out(fn, *args, capacity=64):
    """`u64_view` as a list."""
    return list(u64_view(fn, *args, capacity=capacity))


TopologyOptions = _abi.fsdpturbo_topology_options_t
GradT = _abi.fsdpturbo_grad_t
DIM_SHARD = _abi.FSDPTURBO_DIM_SHARD
MESH_DATA, MESH_MODEL, MESH_EXPERT = _abi.FSDPTURBO_MESH_DATA, _abi.FSDPTURBO_MESH_MODEL, _abi.FSDPTURBO_MESH_EXPERT
