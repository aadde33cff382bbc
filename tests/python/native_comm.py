"""The tests' binding of libfsdpturbo's own collectives (`fsdpturbo_comm_t`): how Python lends a
torch.distributed process group to the Rust core (host callbacks over CPU memory), NCCL
communicators made through the library's run-time loader, and the grad norm of host buffers over
them (the path a C++ trainer takes, here reachable from Python for test_cuda_backend and
test_cuda_ops). It lives with the tests: nothing in the package, benches or examples uses it.
"""
import ctypes
import itertools
import logging

import torch
import torch.distributed as dist

from fsdpturbo import _abi
from fsdpturbo._native import check, lib

__all__ = ["Comm", "host_comm", "single_rank_comm", "nccl_comm", "nccl_comm_for_group", "nccl_version",
           "nccl_unique_id", "clip_grad_norm_host"]

_c = ctypes
logger = logging.getLogger(__name__)
# FSDPTURBO_DTYPE_* codes and the torch dtypes they carry.
_DTYPES = {_abi.FSDPTURBO_DTYPE_U8: torch.uint8, _abi.FSDPTURBO_DTYPE_I32: torch.int32,
           _abi.FSDPTURBO_DTYPE_I64: torch.int64, _abi.FSDPTURBO_DTYPE_F16: torch.float16,
           _abi.FSDPTURBO_DTYPE_BF16: torch.bfloat16, _abi.FSDPTURBO_DTYPE_F32: torch.float32,
           _abi.FSDPTURBO_DTYPE_F64: torch.float64}
_CODES = {v: k for k, v in _DTYPES.items()}
# FSDPTURBO_REDUCE_* codes.
_OPS = {_abi.FSDPTURBO_REDUCE_SUM: dist.ReduceOp.SUM, _abi.FSDPTURBO_REDUCE_MAX: dist.ReduceOp.MAX,
        _abi.FSDPTURBO_REDUCE_PROD: dist.ReduceOp.PRODUCT, _abi.FSDPTURBO_REDUCE_MIN: dist.ReduceOp.MIN}
UNIQUE_ID_BYTES = _abi.FSDPTURBO_NCCL_UNIQUE_ID_BYTES

_ALL_REDUCE = _abi.fsdpturbo_host_all_reduce_fn
_ALL_GATHER = _abi.fsdpturbo_host_all_gather_fn
_ALL_TO_ALL_V = _abi.fsdpturbo_host_all_to_all_v_fn
_HostCollective = _abi.fsdpturbo_host_collective_t
_CommGroup = _abi.fsdpturbo_comm_group_t


def _view(ptr, count, code):
    """A CPU tensor over `count` elements of FSDPTURBO_DTYPE_* `code` at address `ptr` (no copy)."""
    dtype = _DTYPES[code]
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    buf = (_c.c_char * nbytes).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype)


class Comm:
    """An `fsdpturbo_comm_t` handle. Keep the object alive while the library may call back."""

    def __init__(self, handle, keep=(), auto_free=True):
        self.handle = handle
        self._keep = keep
        self._auto_free = auto_free

    def free(self):
        if self.handle:
            lib.fsdpturbo_comm_free(self.handle)
            self.handle = None

    def __del__(self):
        # NCCL communicators are freed explicitly (free() on every rank alike).
        if getattr(self, "_auto_free", False):
            self.free()

    def all_reduce(self, tensor, op=0):
        """In-place all-reduce of a contiguous tensor (CPU for host comms; CUDA, on the current
        stream, for NCCL). `op`: FSDPTURBO_REDUCE_* (0 SUM, 1 MAX, 2 PROD, 3 MIN)."""
        stream = torch.cuda.current_stream(tensor.device).cuda_stream if tensor.is_cuda else None
        check(lib.fsdpturbo_comm_all_reduce(self.handle, tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                                            _CODES[tensor.dtype], op, stream))

    def all_to_all_v(self, send, recv, send_counts, recv_counts):
        """Packed all-to-all-v of rows of contiguous tensors (counts in rows)."""
        row = send[0].numel() if send.dim() > 1 and send.size(0) else (recv[0].numel() if recv.dim() > 1 else 1)

        def sizes(counts):
            elems = [c * row for c in counts]
            displs = [sum(elems[:i]) for i in range(len(elems))]
            return (_c.c_size_t * len(elems))(*elems), (_c.c_size_t * len(elems))(*displs)

        sc, sd = sizes(send_counts)
        rc, rd = sizes(recv_counts)
        stream = torch.cuda.current_stream(send.device).cuda_stream if send.is_cuda else None
        check(lib.fsdpturbo_comm_all_to_all_v(self.handle, send.data_ptr(), recv.data_ptr(), sc, sd, rc, rd,
                                              _CODES[send.dtype], stream))


def single_rank_comm():
    handle = _c.c_void_p()
    check(lib.fsdpturbo_comm_single_new(_c.byref(handle)))
    return Comm(handle)


def host_comm(group=None):
    """Lends the torch.distributed `group` (default: the world; CPU-capable backend such as
    gloo) to the library as host callbacks."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)

    def guarded(fn):
        def call(*args):
            try:
                fn(*args)
                return 0
            except Exception:  # noqa: BLE001 (reported to the library as a status)
                logger.exception("fsdpturbo host collective: the %s callback failed", fn.__name__)
                return 1
        return call

    @guarded
    def all_reduce(_user, send, recv, count, dtype, op):
        out = _view(recv, count, dtype)
        if send != recv:
            out.copy_(_view(send, count, dtype))
        dist.all_reduce(out, op=_OPS[op], group=group)

    @guarded
    def all_gather(_user, send, recv, count, dtype):
        dist.all_gather_into_tensor(_view(recv, count * world, dtype), _view(send, count, dtype), group=group)

    @guarded
    def reduce_scatter(_user, send, recv, count, dtype, op):
        # gloo has no reduce_scatter: an all-reduce of the whole buffer, then this rank's block.
        full = _view(send, count * world, dtype).clone()
        dist.all_reduce(full, op=_OPS[op], group=group)
        _view(recv, count, dtype).copy_(full[rank * count:(rank + 1) * count])

    @guarded
    def all_to_all_v(_user, send, recv, send_counts, send_displs, recv_counts, recv_displs, dtype):
        sc = [send_counts[i] for i in range(world)]
        rc = [recv_counts[i] for i in range(world)]
        sd = [send_displs[i] for i in range(world)]
        rd = [recv_displs[i] for i in range(world)]
        src = _view(send, max((d + c for d, c in zip(sd, sc)), default=0), dtype)
        dst = _view(recv, max((d + c for d, c in zip(rd, rc)), default=0), dtype)
        packed = torch.cat([src[d:d + c] for d, c in zip(sd, sc)])
        out = torch.empty(sum(rc), dtype=_DTYPES[dtype])
        dist.all_to_all_single(out, packed, rc, sc, group=group)
        for d, c, at in zip(rd, rc, itertools.accumulate([0] + rc)):
            dst[d:d + c].copy_(out[at:at + c])

    callbacks = (_ALL_REDUCE(all_reduce), _ALL_GATHER(all_gather), _ALL_REDUCE(reduce_scatter),
                 _ALL_TO_ALL_V(all_to_all_v))
    desc = _HostCollective(_c.sizeof(_HostCollective), rank, world, None, *callbacks)
    handle = _c.c_void_p()
    check(lib.fsdpturbo_comm_host_new(_c.byref(desc), _c.byref(handle)))
    return Comm(handle, keep=callbacks)


def nccl_version():
    """(code, "X.Y.Z") of the NCCL the library loads."""
    v = _c.c_int32()
    check(lib.fsdpturbo_nccl_version(_c.byref(v)))
    code = v.value
    major, rest = (code // 10000, code % 10000) if code >= 20900 else (code // 1000, code % 1000)
    return code, f"{major}.{rest // 100}.{rest % 100}"


def nccl_unique_id():
    buf = _c.create_string_buffer(UNIQUE_ID_BYTES)
    check(lib.fsdpturbo_nccl_unique_id(buf))
    return buf.raw


def nccl_comm(unique_id, world_size, rank, device, timeout_ms=None):
    """Joins an NCCL communicator through the library's loader (CUDA `device` ordinal), with the
    library's default deadline or `timeout_ms`."""
    handle = _c.c_void_p()
    if timeout_ms is None:
        check(lib.fsdpturbo_comm_nccl_new(unique_id, world_size, rank, device, _c.byref(handle)))
    else:
        check(lib.fsdpturbo_comm_nccl_new_with_timeout(unique_id, world_size, rank, device, timeout_ms,
                                                        _c.byref(handle)))
    return Comm(handle, auto_free=False)


def nccl_comm_for_group(group=None, device=None):
    """An NCCL communicator over the ranks of torch.distributed `group` (default: the world):
    rank 0 of the group makes the unique id and the group broadcasts it (any backend, gloo
    too); every rank of the group must call this. `device`: the CUDA ordinal (default: the
    current device)."""
    device = torch.cuda.current_device() if device is None else device
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    box = [nccl_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(box, group_src=0, group=group)
    return nccl_comm(box[0], world, rank, device)


_Grad = _abi.fsdpturbo_grad_t
_ClipOptions = _abi.fsdpturbo_clip_options_t
_GRAD_DTYPES = {torch.float32: _abi.FSDPTURBO_DTYPE_F32, torch.float64: _abi.FSDPTURBO_DTYPE_F64,
                torch.float16: _abi.FSDPTURBO_DTYPE_F16, torch.bfloat16: _abi.FSDPTURBO_DTYPE_BF16}


def clip_grad_norm_host(grads, layouts, groups, max_norm, norm_type=2.0):
    """`fsdpturbo_clip_grad_norm_comm` on contiguous CPU tensors: `layouts[i]` is a list of
    (mesh-dim id, role) with role 0 Shard, 1 Replicate; `groups` maps a tuple of mesh-dim ids to
    the Comm that reduces over them. Scales in place; returns the total norm."""
    keep = []
    arr = (_Grad * len(grads))()
    for i, (g, layout) in enumerate(zip(grads, layouts)):
        dims = (_c.c_uint32 * max(len(layout), 1))(*[d for d, _ in layout])
        roles = (_c.c_int32 * max(len(layout), 1))(*[r for _, r in layout])
        keep += [dims, roles]
        arr[i] = _Grad(None, g.data_ptr() if g.numel() else None, g.numel(), _GRAD_DTYPES[g.dtype], dims, roles,
                       len(layout))
    entries = (_CommGroup * max(len(groups), 1))()
    for i, (dims, comm) in enumerate(groups.items()):
        d = (_c.c_uint32 * len(dims))(*dims)
        keep.append(d)
        entries[i] = _CommGroup(d, len(dims), comm.handle)
    options = _ClipOptions(_c.sizeof(_ClipOptions), max_norm, norm_type, False, True)
    total = _c.c_double()
    check(lib.fsdpturbo_clip_grad_norm_comm(_c.byref(options), arr, len(grads), entries, len(groups),
                                            _c.byref(total)))
    return total.value
