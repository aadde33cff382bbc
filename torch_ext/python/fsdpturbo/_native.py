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

_PACKAGE = pathlib.Path(__file__).resolve().parent
_REPO = _PACKAGE.parents[2]


def _find(env, filename, build_dirs):
    candidates = []
    if os.environ.get(env):
        candidates.append(pathlib.Path(os.environ[env]))
    candidates.append(_PACKAGE / "lib" / filename)
    candidates += [_REPO / d / filename for d in build_dirs]
    for path in candidates:
        if path.is_file():
            return path
    searched = "\n  ".join(str(p) for p in candidates)
    raise ImportError(f"fsdpturbo: cannot find {filename}; searched:\n  {searched}\n"
                      f"Build it (scripts/setup.sh) or point {env} at it.")


LIB_PATH = _find("FSDPTURBO_LIB", "libfsdpturbo.so", ["target/release"])
TORCH_LIB_PATH = _find("FSDPTURBO_TORCH_LIB", "libfsdpturbo_torch.so", ["build/torch_ext"])

lib = ctypes.CDLL(str(LIB_PATH))


def wheel_library_dirs():
    """The `lib` folders of the installed NVIDIA wheels (`nvidia/*/lib`: NCCL, cuBLAS, NVRTC),
    which libfsdpturbo searches after its FSDPTURBO_*_PATH variables."""
    try:
        import nvidia
    except ImportError:
        return []
    roots = [pathlib.Path(p) for p in getattr(nvidia, "__path__", [])]
    return sorted({str(d) for root in roots for d in root.glob("*/lib") if d.is_dir()})


_dirs = [d.encode() for d in wheel_library_dirs()]
lib.fsdpturbo_add_library_dirs.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t]
lib.fsdpturbo_add_library_dirs((ctypes.c_char_p * len(_dirs))(*_dirs), len(_dirs))
torch.ops.load_library(str(TORCH_LIB_PATH))
ops = torch.ops.fsdpturbo
from . import moe_ops  # noqa: E402,F401  (autograd and fakes of the MoE ops, once the library is loaded)

# Status codes (include/fsdpturbo.h).
OK = 0
_STATUS = {1: "NULL_ARGUMENT", 2: "INVALID_ARGUMENT", 3: "CONFIG", 4: "TOPOLOGY", 5: "PLAN",
           6: "STATE", 7: "BUFFER_TOO_SMALL", 8: "UNAVAILABLE", 9: "STRUCT_SIZE", 10: "UTF8",
           11: "NOT_FOUND", 99: "PANIC"}


class FsdpturboError(RuntimeError):
    """A failure reported by libfsdpturbo; `status` is the FSDPTURBO_ERR_* name."""

    def __init__(self, message, status):
        super().__init__(message)
        self.status = status


class FsdpturboValueError(FsdpturboError, ValueError):
    """Bad input (configuration, topology sizes, arguments): also a ValueError, like the seed's."""


class FsdpturboKeyError(FsdpturboError, KeyError):
    """A registry has no entry for the name asked for: also a KeyError, like the seed's."""

    __str__ = RuntimeError.__str__


def last_error():
    n = lib.fsdpturbo_last_error(None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    lib.fsdpturbo_last_error(buf, n + 1)
    return buf.value.decode("utf-8", "replace")


def check(status):
    """Raises the library's last error for a non-zero status."""
    if status == OK:
        return
    name = _STATUS.get(status, str(status))
    cls = FsdpturboValueError if name in ("NULL_ARGUMENT", "INVALID_ARGUMENT", "CONFIG", "TOPOLOGY",
                                         "UTF8", "STRUCT_SIZE") else FsdpturboError
    cls = FsdpturboKeyError if name == "NOT_FOUND" else cls
    raise cls(last_error(), name)


def string_out(fn, *args):
    """Calls a `(..., char *buf, size_t cap, size_t *out_len)` function twice: size, then text."""
    needed = ctypes.c_size_t(0)
    status = fn(*args, None, 0, ctypes.byref(needed))
    if status not in (OK, 7):
        check(status)
    buf = ctypes.create_string_buffer(needed.value)
    check(fn(*args, buf, needed.value, ctypes.byref(needed)))
    return buf.value.decode("utf-8")


def u64_out(fn, *args, capacity=64):
    """Calls a `(..., uint64_t *buf, size_t cap, size_t *out_len)` function; returns a list."""
    while True:
        buf = (ctypes.c_uint64 * capacity)()
        n = ctypes.c_size_t(0)
        status = fn(*args, buf, capacity, ctypes.byref(n))
        if status == 7 and n.value > capacity:
            capacity = n.value
            continue
        check(status)
        return list(buf[: n.value])


class TopologyOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("world_size", ctypes.c_uint64),
                ("dp_size", ctypes.c_uint64), ("cp_size", ctypes.c_uint64),
                ("mp_replicate_size", ctypes.c_uint64), ("mp_shard_size", ctypes.c_uint64),
                ("ep_size", ctypes.c_uint64), ("efsdp_size", ctypes.c_uint64)]


class GradT(ctypes.Structure):
    """fsdpturbo_grad_t."""
    _fields_ = [("data", ctypes.c_void_p), ("mut_data", ctypes.c_void_p), ("numel", ctypes.c_size_t),
                ("dtype", ctypes.c_int32), ("dims", ctypes.POINTER(ctypes.c_uint32)),
                ("roles", ctypes.POINTER(ctypes.c_int32)), ("n_dims", ctypes.c_size_t)]


DIM_SHARD = 0  # FSDPTURBO_DIM_SHARD

_c = ctypes
_SIGNATURES = {
    "fsdpturbo_last_error": (_c.c_size_t, [_c.c_char_p, _c.c_size_t]),
    "fsdpturbo_version": (_c.c_char_p, []),
    "fsdpturbo_abi_version": (_c.c_uint32, []),
    "fsdpturbo_config_parse": (_c.c_int32, [_c.c_char_p, _c.c_size_t, _c.POINTER(_c.c_void_p)]),
    "fsdpturbo_config_free": (None, [_c.c_void_p]),
    "fsdpturbo_config_to_json": (_c.c_int32, [_c.c_void_p, _c.c_char_p, _c.c_size_t, _c.POINTER(_c.c_size_t)]),
    "fsdpturbo_topology_new": (_c.c_int32, [_c.POINTER(TopologyOptions), _c.POINTER(_c.c_void_p)]),
    "fsdpturbo_topology_free": (None, [_c.c_void_p]),
    "fsdpturbo_topology_size": (_c.c_int32, [_c.c_void_p, _c.c_char_p, _c.POINTER(_c.c_uint64)]),
    "fsdpturbo_topology_mesh_shape": (_c.c_int32, [_c.c_void_p, _c.c_int32, _c.POINTER(_c.c_uint64),
                                                   _c.c_size_t, _c.POINTER(_c.c_size_t)]),
    "fsdpturbo_topology_coordinate": (_c.c_int32, [_c.c_void_p, _c.c_int32, _c.c_uint64,
                                                   _c.POINTER(_c.c_uint64), _c.c_size_t, _c.POINTER(_c.c_size_t)]),
    "fsdpturbo_topology_group": (_c.c_int32, [_c.c_void_p, _c.c_int32, _c.c_char_p, _c.c_uint64,
                                              _c.POINTER(_c.c_uint64), _c.c_size_t, _c.POINTER(_c.c_size_t)]),
    "fsdpturbo_state_initialize": (_c.c_int32, [_c.c_void_p]),
    "fsdpturbo_state_get": (_c.c_int32, [_c.POINTER(_c.c_void_p)]),
    "fsdpturbo_state_reset": (None, []),
    "fsdpturbo_module_name_match": (_c.c_int32, [_c.c_char_p, _c.c_char_p, _c.POINTER(_c.c_bool)]),
    "fsdpturbo_spec_register": (_c.c_int32, [_c.c_char_p, _c.POINTER(_c.c_char_p), _c.c_size_t,
                                             _c.POINTER(_c.c_char_p), _c.c_size_t]),
    "fsdpturbo_spec_to_json": (_c.c_int32, [_c.c_char_p, _c.c_char_p, _c.c_size_t, _c.POINTER(_c.c_size_t)]),
    "fsdpturbo_norm_plan": (_c.c_int32, [_c.POINTER(GradT), _c.c_size_t, _c.POINTER(_c.c_size_t),
                                         _c.POINTER(_c.c_size_t), _c.c_size_t, _c.POINTER(_c.c_size_t),
                                         _c.POINTER(_c.c_uint32), _c.c_size_t, _c.POINTER(_c.c_size_t)]),
}
for _name, (_restype, _argtypes) in _SIGNATURES.items():
    _fn = getattr(lib, _name)
    _fn.restype = _restype
    _fn.argtypes = _argtypes

MESH_DATA, MESH_MODEL, MESH_EXPERT = 0, 1, 2

for _name, (_restype, _argtypes) in {
    "fsdpturbo_pattern_compile": (_c.c_int32, [_c.c_char_p, _c.POINTER(_c.c_void_p)]),
    "fsdpturbo_pattern_match": (_c.c_int32, [_c.c_void_p, _c.c_char_p, _c.POINTER(_c.c_bool)]),
    "fsdpturbo_pattern_free": (None, [_c.c_void_p]),
    "fsdpturbo_op_register": (_c.c_int32, [_c.c_char_p, _c.c_char_p, _c.POINTER(_c.c_uint64),
                                           _c.POINTER(_c.c_uint64)]),
    "fsdpturbo_op_resolve": (_c.c_int32, [_c.c_char_p, _c.c_char_p, _c.POINTER(_c.c_uint64),
                                          _c.POINTER(_c.c_int32)]),
    "fsdpturbo_op_fallback_warning": (_c.c_int32, [_c.c_char_p, _c.c_char_p, _c.c_char_p, _c.c_size_t,
                                                   _c.POINTER(_c.c_size_t)]),
    "fsdpturbo_op_table_json": (_c.c_int32, [_c.c_char_p, _c.c_size_t, _c.POINTER(_c.c_size_t)]),
}.items():
    _fn = getattr(lib, _name)
    _fn.restype = _restype
    _fn.argtypes = _argtypes
