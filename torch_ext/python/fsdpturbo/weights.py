"""Weights: building a model with parameters on meta, loading a Hugging Face safetensors
checkpoint into a sharded model (shard-on-read: each rank reads only the bytes of its own
DTensor slices, the slice `copy_weights_` takes, planned by the Rust core), and gathering and
saving the full state dict back in Hugging Face's format.

Checkpoint names are the model's parameter names, or for fused expert weights
(`…experts.gate_up_proj` [E, 2I, H], `…experts.down_proj` [E, H, I]) the per-expert layout
Hugging Face writes (`…experts.{e}.gate_proj.weight` then `.up_proj.weight` concatenated on
dim 0; `…experts.{e}.down_proj.weight`), the layout of the Qwen MoE families.
"""
import bisect
import contextlib
import ctypes
import hashlib
import json
import logging
import math
import os
import stat

import torch
from torch import nn

from . import _dist, hf_layout
from .placement import _load_placement, _slice_target, copy_weights_, gather_full
from .progress import Progress

logger = logging.getLogger(__name__)

__all__ = ["load_hf_weights", "full_state_dict", "meta_parameters", "save_hf_weights"]


@contextlib.contextmanager
def meta_parameters():
    """Within this context, modules create their parameters on the meta device and their
    buffers as usual (real, e.g. rotary frequencies), like accelerate's
    `init_empty_weights()`: build the model here, then `shard_model(..., weights=...)`."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def checkpoint_files(path):
    """The safetensors files of a checkpoint: `path` itself, or in a directory the files of
    `model.safetensors.index.json`, else `model.safetensors`, else every `*.safetensors`. Each is
    a regular file (not a FIFO or a device, which would block or never end); an index may name
    only files inside the directory (ValueError for `../x` or an absolute path)."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"fsdpturbo: checkpoint {path!r} is neither a safetensors file nor a directory")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [_inside(path, name, index) for name in names]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    files = sorted(_inside(path, n, path) for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"fsdpturbo: no .safetensors file in {path!r} (only safetensors checkpoints "
                                f"are read)")
    return files


def _inside(directory, name, where):
    """The file `name` of the checkpoint `directory`, as `where` names it: a relative path that
    stays inside the directory (no `..` part) of a regular file. A link inside it may point
    elsewhere (the Hugging Face cache links each file to its blob)."""
    if not isinstance(name, str) or not name or os.path.isabs(name) or ".." in name.split("/") \
            or ".." in name.split(os.sep):
        raise ValueError(f"fsdpturbo: {where!r} names the file {name!r}, which is not inside {directory!r}; a "
                         f"checkpoint's files must be in its directory")
    file = os.path.join(directory, name)
    if not os.path.exists(file):
        raise FileNotFoundError(f"fsdpturbo: {where!r} names the file {name!r}, which does not exist")
    if not os.path.isfile(file):
        raise ValueError(f"fsdpturbo: {where!r} names the file {name!r}, which is not a regular file")
    return file


def _open_regular(path):
    """A read-only descriptor of the regular file `path`: opened without blocking (a FIFO would
    wait for a writer) and checked before anything is read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"fsdpturbo: checkpoint file {path!r} is not a regular file")
    return fd


_TORCH_DTYPES = {  # safetensors dtype names -> torch dtype attribute names (those this torch has)
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
    "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16", "F32": "float32",
    "F64": "float64", "C64": "complex64", "F8_E5M2": "float8_e5m2", "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
}
_CHUNK = 64 << 20  # bytes per read call (progress granularity; Linux caps one read below 2 GiB)


def _torch_dtype(name, where):
    dtype = getattr(torch, _TORCH_DTYPES.get(name, ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: dtype {name} has no torch dtype in torch {torch.__version__}")
    return dtype


def _file_error(path, err):
    """The library's error about checkpoint file `path`, the same class, naming the file."""
    from ._native import FSDPTurboError

    message = f"fsdpturbo: checkpoint file {path!r}: {err}"
    return type(err)(message, err.status) if isinstance(err, FSDPTurboError) else type(err)(message)


def _header_bytes(fd):
    """The bytes of a safetensors file before its data section (the 8-byte length and the JSON
    header), as many as its length says within the format's limit; a short file gives fewer (the
    parser names the bytes needed and given)."""
    from . import _native

    prefix = os.pread(fd, 8, 0)
    need = ctypes.c_uint64(0)
    _native.check(_native.lib.fsdpturbo_safetensors_header_size(prefix, len(prefix), ctypes.byref(need)))
    return os.pread(fd, need.value, 0)


_SAMPLE = 1 << 20  # bytes of data hashed at each end of a file by `checkpoint_fingerprint`


def checkpoint_fingerprint(path):
    """What identifies the safetensors checkpoint at `path` for a cross-rank comparison, cheaply:
    per file, its size, the SHA-256 of its header (every tensor's name, dtype, shape and byte
    range) and of a sample of its data (the first and last MiB). The path is not part of it:
    equal copies at different paths (a node-local copy per host) are the same checkpoint."""
    from ._native import FSDPTurboError

    files = {}
    for file in checkpoint_files(path):
        fd = _open_regular(file)
        try:
            size, header = os.fstat(fd).st_size, _header_bytes(fd)
            sample = os.pread(fd, _SAMPLE, len(header)) + os.pread(fd, _SAMPLE, max(len(header), size - _SAMPLE))
            files[os.path.basename(file)] = {"bytes": size, "header sha256": hashlib.sha256(header).hexdigest(),
                                             "sample sha256": hashlib.sha256(sample).hexdigest()}
        except FSDPTurboError as e:
            raise _file_error(file, e) from None
        finally:
            os.close(fd)
    return {"files": files}


class _File:
    """One safetensors file: its header, parsed and validated by the Rust core (offsets that tile
    the data section, sizes that match shapes, a file as long as its header says), and an open
    descriptor to `pread` from."""

    def __init__(self, path):
        from . import _native

        self.path, self.fd, self.handle = path, _open_regular(path), ctypes.c_void_p()
        try:
            size = os.fstat(self.fd).st_size
            if hasattr(os, "posix_fadvise"):  # no read-ahead: it would read the other ranks' bytes too
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
            header = _header_bytes(self.fd)
            _native.check(_native.lib.fsdpturbo_safetensors_parse(header, len(header), size,
                                                                  ctypes.byref(self.handle)))
            names = _native.string_out(_native.lib.fsdpturbo_safetensors_tensor_names, self.handle)
            layout = _native.u64_view(_native.lib.fsdpturbo_safetensors_tensor_layout, self.handle)
        except _native.FSDPTurboError as e:
            self.close()
            raise _file_error(path, e) from None
        except BaseException:
            self.close()
            raise
        self.header_bytes = len(header)
        self.tensors = {}  # name -> shape
        # The first byte of each tensor in file order, to name the tensor of a failed read.
        self._begins, self._names = [], []
        at = char = 0
        while at < len(layout):
            chars, begin, ndim = layout[at], layout[at + 1], layout[at + 2]
            name = names[char:char + chars]
            self.tensors[name] = tuple(layout[at + 3:at + 3 + ndim])
            self._begins.append(begin)
            self._names.append(name)
            at, char = at + 3 + ndim, char + chars

    def tensor_at(self, offset):
        i = bisect.bisect_right(self._begins, offset) - 1
        return self._names[max(i, 0)] if self._names else "?"

    def close(self):
        from . import _native

        if self.handle:
            _native.lib.fsdpturbo_safetensors_free(self.handle)
            self.handle = ctypes.c_void_p()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


MAX_HEADER_BYTES = 128 << 20  # of all the headers of one checkpoint (real ones total a few MB)


class _Checkpoint:
    """The files of a checkpoint and the reads of each model tensor's local slice. Every header
    is parsed up front and kept: their total size is bounded by MAX_HEADER_BYTES."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.files = []
        try:
            for f in checkpoint_files(path):
                self.files.append(_File(f))
                total = sum(file.header_bytes for file in self.files)
                if total > MAX_HEADER_BYTES:
                    raise ValueError(f"fsdpturbo: the headers of checkpoint {self.path!r} hold {total} bytes by "
                                     f"{f!r}, more than the limit of {MAX_HEADER_BYTES}")
        except BaseException:
            self.close()
            raise
        self.where = {key: i for i, f in enumerate(self.files) for key in f.tensors}
        self._handles = (ctypes.c_void_p * max(len(self.files), 1))(*[f.handle for f in self.files])
        self.used = set()
        self.bytes_read = 0

    def close(self):
        for f in self.files:
            f.close()

    def sources(self, name, num_rows):
        """The keys holding model tensor `name`: its own key (a str), or per expert the keys
        concatenated into its row (the per-expert layout); None when the checkpoint has neither."""
        if name in self.where:
            self.used.add(name)
            return name
        keys = hf_layout.per_expert_keys(name, num_rows)
        if keys is None or not all(k in self.where for row in keys for k in row):
            return None
        self.used.update(k for row in keys for k in row)
        return keys

    def plan(self, sources, global_shape, mesh_shape=(), rank=0, triples=()):
        """The reads of the local slice of the tensor made of `sources`: (torch dtype, local
        shape, [(file, offset, length, dst)]), from the Rust core (DTensor-exact slicing)."""
        from . import _abi, _native

        c = ctypes
        names = [sources] if isinstance(sources, str) else [k for row in sources for k in row]
        parts_per_row = 0 if isinstance(sources, str) else len(sources[0])
        encoded = (c.c_char_p * len(names))(*[n.encode() for n in names])
        shape = (c.c_uint64 * max(len(global_shape), 1))(*global_shape)
        mesh = (c.c_uint64 * max(len(mesh_shape), 1))(*mesh_shape)
        P = _abi.fsdpturbo_placement_t
        placements = (P * max(len(mesh_shape), 1))(*[P(*triples[i: i + 3]) for i in range(0, len(triples), 3)])
        handle = c.c_void_p()
        lib = _native.lib
        try:
            _native.check(lib.fsdpturbo_safetensors_read_plan_new(
                self._handles, len(self.files), encoded, len(names), parts_per_row, shape, len(global_shape), mesh,
                len(mesh_shape), placements, rank, c.byref(handle)))
            try:
                dtype = _native.string_out(lib.fsdpturbo_read_plan_dtype, handle)
                local_shape = _native.u64_out(lib.fsdpturbo_read_plan_local_shape, handle, capacity=8)
                n = c.c_size_t(0)
                status = lib.fsdpturbo_read_plan_ranges(handle, None, 0, c.byref(n))
                if status != _native.BUFFER_TOO_SMALL:
                    _native.check(status)
                ranges = (_abi.fsdpturbo_byte_range_t * max(n.value, 1))()
                _native.check(lib.fsdpturbo_read_plan_ranges(handle, ranges, n.value, c.byref(n)))
            finally:
                lib.fsdpturbo_read_plan_free(handle)
        except _native.FSDPTurboError as e:
            raise _file_error(self.files[self.where[names[0]]].path, e) from None
        reads = [(r.file, r.offset, r.length, r.dst_offset) for r in ranges[: n.value]]
        return _torch_dtype(dtype, f"fsdpturbo: tensor {names[0]!r}"), tuple(local_shape), reads

    def read(self, reads, buffer, progress=None):
        """Fills `buffer` (a contiguous CPU tensor of the plan's local shape and dtype) by
        `pread`ing `reads`; a read that ends before its bytes is an error naming file and tensor."""
        nbytes = buffer.numel() * buffer.element_size()
        if not nbytes:
            return buffer
        view = memoryview((ctypes.c_char * nbytes).from_address(buffer.data_ptr())).cast("B")
        for file, offset, length, dst in reads:
            f = self.files[file]
            done = 0
            while done < length:
                n = os.preadv(f.fd, [view[dst + done: dst + min(length, done + _CHUNK)]], offset + done)
                if n <= 0:
                    raise OSError(f"fsdpturbo: checkpoint file {f.path!r}: tensor {f.tensor_at(offset + done)!r}: "
                                  f"the file ends at byte {os.fstat(f.fd).st_size} but the tensor's bytes run to "
                                  f"{offset + length}: the file is truncated (or shrank while loading)")
                done += n
                if progress is not None:
                    progress.update(n)
            self.bytes_read += length
        return buffer

    def full(self, sources):
        """The whole tensor made of `sources` (a plain read of every byte)."""
        dtype, shape, reads = self.plan(sources, self._global_shape(sources))
        return self.read(reads, torch.empty(shape, dtype=dtype))

    def _global_shape(self, sources):
        shape = lambda k: self.files[self.where[k]].tensors[k]  # noqa: E731
        if isinstance(sources, str):
            return shape(sources)
        first = shape(sources[0][0])
        return (len(sources), sum(shape(k)[0] for k in sources[0]), *first[1:])


def check_files(path):
    """Raises the error of the first file of the safetensors checkpoint at `path` that the
    loader would refuse (its header, its size, the limits): for readers with their own parser."""
    _Checkpoint(path).close()


def _local_target(param, where):
    """(the tensor to fill, mesh shape, mesh rank, placement triples) of a parameter or buffer; the
    tensor is None on a rank outside a DTensor's mesh (it holds nothing)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param.data if isinstance(param, nn.Parameter) else param, (), 0, []
    mesh, _, triples, coordinate = _load_placement(param, where)
    if coordinate is None:
        return None, (), 0, []
    mesh_shape = tuple(mesh.shape)
    rank = 0
    for c, n in zip(coordinate, mesh_shape):
        rank = rank * n + c
    return param.to_local(), mesh_shape, rank, triples


def _fill(checkpoint, local, dtype, shape, reads, where, progress):
    """Reads this rank's slice into `local` (the local tensor): straight into its storage when it
    is a contiguous CPU tensor of the checkpoint's dtype, else through a buffer (cast, moved)."""
    target = _slice_target(local, shape, where, "of the checkpoint tensor")
    if target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous():
        checkpoint.read(reads, target, progress)
    else:
        target.copy_(checkpoint.read(reads, torch.empty(shape, dtype=dtype), progress))


def load_hf_weights(model, path, copy_fn=None):
    """Loads the checkpoint at `path` (a safetensors file or a Hugging Face model directory)
    into `model`'s parameters and persistent buffers. Shard-on-read: each rank reads only the
    bytes of its own DTensor slices (exactly `copy_weights_`'s slice: torch DTensor's, uneven
    and empty shards and _StridedShard included, planned by the Rust core, per-expert keys
    included) with `pread` straight into the local tensor, cast to the parameter's dtype where
    it differs; plain tensors are read whole. With `copy_fn(param, full)` every tensor is read
    whole instead and handed to it (a custom slicing). Every parameter must be found (KeyError
    listing the missing ones, raised on every rank before anything is read); checkpoint keys the
    model does not use are logged; a corrupt or truncated file is an error naming the file and
    the tensor. Rank 0 shows a progress bar on a terminal when the load takes more than 3 s.
    Returns the names loaded."""
    checkpoint = _Checkpoint(path)
    try:
        return _load(model, path, checkpoint, None if copy_fn is copy_weights_ else copy_fn)
    finally:
        checkpoint.close()


def _load(model, path, checkpoint, copy_fn):
    params = [(name, p, checkpoint.sources(name, p.shape[0] if p.dim() else 0)) for name, p in model.named_parameters()]
    missing = [name for name, _, sources in params if sources is None]
    if missing:
        raise KeyError(f"fsdpturbo: the checkpoint {os.fspath(path)!r} holds no value for the parameters "
                       f"{missing}")
    persistent = {n for n, _ in _persistent_buffers(model)}
    params += [(name, b, checkpoint.sources(name, 0)) for name, b in model.named_buffers()
               if name in persistent and name in checkpoint.where]
    if copy_fn is not None:
        for name, tensor, sources in params:
            copy_fn(tensor, checkpoint.full(sources))
        _log_unused(checkpoint)
        return [name for name, _, _ in params]
    # Plan every read first: a tensor that does not fit fails on every rank before anything is read.
    planned = []
    for name, tensor, sources in params:
        where = f"fsdpturbo.load_hf_weights: {name}"
        local, mesh_shape, rank, triples = _local_target(tensor, where)
        if local is None:
            continue
        planned.append((name, local, checkpoint.plan(sources, tuple(tensor.shape), mesh_shape, rank, triples)))
    total = sum(math.prod(shape) * dtype.itemsize for _, _, (dtype, shape, _) in planned)
    with torch.no_grad(), Progress(total, "fsdpturbo: loading weights") as progress:
        for name, local, (dtype, shape, reads) in planned:
            _fill(checkpoint, local, dtype, shape, reads, f"fsdpturbo.load_hf_weights: {name}", progress)
    _log_unused(checkpoint)
    return [name for name, _, _ in params]


def _log_unused(checkpoint):
    unused = sorted(set(checkpoint.where) - checkpoint.used)
    if unused:
        logger.info("fsdpturbo: %d checkpoint tensors are not used by the model: %s", len(unused), unused[:8])


def _full_read_reference(model, path):
    """The loader before shard-on-read, kept only as the reference of the benchmark
    (benches/shard_read.py) and of the equality test: `safe_open` on every file, every full
    tensor read on every rank (per-expert keys stacked), each through `copy_weights_`."""
    from safetensors import safe_open

    files = [safe_open(f, framework="pt") for f in checkpoint_files(path)]
    where = {key: f for f in files for key in f.keys()}
    probe = _Checkpoint.__new__(_Checkpoint)  # its `sources` rule, over the same names
    probe.where, probe.used = where, set()

    def tensor(sources):
        if isinstance(sources, str):
            return where[sources].get_tensor(sources)
        return hf_layout.stack(sources, lambda key: where[key].get_tensor(key))

    loaded = []
    for name, param in model.named_parameters():
        sources = probe.sources(name, param.shape[0] if param.dim() else 0)
        if sources is None:
            raise KeyError(f"fsdpturbo: the checkpoint {os.fspath(path)!r} holds no value for {name}")
        copy_weights_(param, tensor(sources))
        loaded.append(name)
    persistent = {n for n, _ in _persistent_buffers(model)}
    for name, buffer in model.named_buffers():
        if name in persistent and name in where:
            copy_weights_(buffer, where[name].get_tensor(name))
            loaded.append(name)
    return loaded


def _persistent_buffers(model):
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buffer


def full_state_dict(model, device="cpu", rank=None):
    """The full (unsharded) parameters and persistent buffers of `model` by name, on `device`,
    each DTensor gathered with `gather_full` (bitwise equal to `full_tensor()`). Collective:
    every rank calls it; every rank gets the whole dict, or with `rank` only that rank (the
    others get {} and hold one tensor at a time)."""
    from torch.distributed.tensor import DTensor

    keep = rank is None or _dist.rank() == rank
    out = {}
    for name, tensor in list(model.named_parameters()) + list(_persistent_buffers(model)):
        full = gather_full(tensor) if isinstance(tensor, DTensor) else tensor.detach().clone()
        if keep:
            out[name] = full.to(device)
    return out


def save_hf_weights(model, path, rank=0):
    """Saves `model` (sharded or not) as a Hugging Face checkpoint directory at `path`: the full
    state dict is gathered on every rank (collective), then rank `rank` writes it with the
    model's own `save_pretrained(path, state_dict=...)` (its config and Hugging Face's on-disk
    layout, e.g. per-expert weights). Every rank returns `path` after the files exist."""
    state = full_state_dict(model, rank=rank)
    if _dist.rank() == rank:
        model.save_pretrained(os.fspath(path), state_dict=state)
    _dist.barrier()
    return path
