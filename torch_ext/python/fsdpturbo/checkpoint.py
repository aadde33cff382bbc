"""Training checkpoints on `torch.distributed.checkpoint` (DCP), loadable at any layout.

A checkpoint is a directory:

    model/        DCP: the model state dict (DTensor shards as saved, plain tensors once)
    optimizer/    DCP: the optimizer state dict (`get_optimizer_state_dict`: moments and step per
                  parameter name, param groups), absent when saved without an optimizer
    extra.pt      the caller's `extra` (rank 0's copy: LR scheduler, step, data position, ...)
    rng/rank{r}.pt  each rank's RNG states (Python, NumPy when present, torch CPU and accelerator)
    fsdpturbo.json  what saved it: format, library version, world size, layout, step

`model/` and `optimizer/` are exactly what LlamaFactory's fsdp2 `save_checkpoint` writes, so
either side loads the other's checkpoints. DCP stores every tensor with its global shape and
reshards on load: a checkpoint saved at one (ep, efsdp, edp, cp, world size) loads at any other
the model allows, ep = 1 included. A save goes to a directory of its own (`fsdpturbo.staging`)
and is renamed into place only once every rank has written and it is on disk, so a crash
mid-save leaves the previous checkpoint intact; only a checkpoint is replaced.
"""
import contextlib
import glob
import hashlib
import json
import logging
import os
import random
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from ._dist import rank, world_size
from .consistency import check_same_on_every_rank, collective_step, every_rank_error, failure_of
from .progress import Progress
from .safe_load import SafeFileSystemReader, SafeLoadPlanner, load_plain, plain_bytes
from .staging import check_target, new_staging, normalised, replace, write_synced

logger = logging.getLogger(__name__)

__all__ = ["AsyncCheckpoint", "CheckpointError", "load_checkpoint", "load_model_weights", "save_checkpoint"]

FORMAT = "fsdpturbo-checkpoint/1"
MANIFEST = "fsdpturbo.json"
_OPTIONS = StateDictOptions(full_state_dict=False, cpu_offload=True)


class CheckpointError(RuntimeError):
    """A save or load failed on some rank: raised on every rank, naming each failing rank and
    its cause; also a ValueError, FileNotFoundError, ... when every cause is one (with one
    process, a failure before DCP's own reads and writes raises its cause itself)."""


@contextlib.contextmanager
def dcp_failures(action):
    """DCP reports a failure on any rank as a `CheckpointException` on every rank, which is a
    BaseException (an `except Exception` misses it): re-raised as a CheckpointError naming
    each rank's cause."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        raise every_rank_error(action, {rank: failure_of(error) for rank, (error, _) in e.failures.items()},
                               CheckpointError) from e


def _on_every_rank(action, step):
    """`step()` on this rank, then every rank raises a CheckpointError if it failed on any."""
    return collective_step(action, step, CheckpointError)


def _tensor_bytes(state):
    from torch.distributed.tensor import DTensor

    total = 0
    for value in state.values():
        if isinstance(value, dict):
            total += _tensor_bytes(value)
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            total += local.numel() * local.element_size()
    return total


class _SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, advancing a progress bar as tensors are handed to the writer."""

    def __init__(self, bar):
        super().__init__()
        self.bar = bar

    def resolve_data(self, write_item):
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor):
            self.bar.update(data.numel() * data.element_size())
        return data


class _LoadPlanner(SafeLoadPlanner):
    """DCP's load planner (non-tensor entries read without code), advancing a progress bar as
    tensors arrive."""

    def __init__(self, bar):
        super().__init__()
        self.bar = bar

    def commit_tensor(self, read_item, tensor):
        super().commit_tensor(read_item, tensor)
        self.bar.update(tensor.numel() * tensor.element_size())


def _rng_state():
    """This rank's RNG states as tensors and plain values (NumPy's key array as a tensor)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy

        name, key, *rest = numpy.random.get_state()
        state["numpy"] = (name, torch.from_numpy(key.astype(numpy.int64)), *rest)
    except ImportError:
        pass
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is not None:
        state[accelerator.type] = torch.get_device_module(accelerator.type).get_rng_state()
    return state


def _set_rng_state(state):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy

        name, key, *rest = state["numpy"]
        numpy.random.set_state((name, key.numpy().astype(numpy.uint32), *rest))
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is not None and accelerator.type in state:
        torch.get_device_module(accelerator.type).set_rng_state(state[accelerator.type])


def _plain(extra):
    """`extra` with every object that has a `state_dict()` (scheduler, data loader) replaced by it."""
    return {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in (extra or {}).items()}


def _layout():
    from .topology import get_parallel_state

    state = get_parallel_state()
    if state is None:
        return None
    return {name: getattr(state, f"{name}_size") for name in ("dp", "cp", "ep", "efsdp", "edp")}


class AsyncCheckpoint:
    """A save in progress (`save_checkpoint(..., async_save=True)`). `wait()` is collective:
    every rank calls it; it returns once the checkpoint is complete and in place, or raises
    (again on a second call) why it is not."""

    def __init__(self, save, futures):
        self._save, self._futures, self._outcome = save, futures, None
        self._key = _pending_key(save.path)
        _PENDING[self._key] = self

    def wait(self):
        if self._outcome is None:
            try:
                with dcp_failures(self._save.action):
                    for future in self._futures:
                        future.result()
                self._save.finish()
                self._outcome = True
            except BaseException as e:
                self._save.abandon()
                self._outcome = e
                raise
            finally:
                if _PENDING.get(self._key) is self:
                    del _PENDING[self._key]
        if self._outcome is not True:
            raise self._outcome


_PENDING = {}  # real path -> this process's AsyncCheckpoint to it that is not waited for yet


def _pending_key(path):
    """One key for every spelling of a target (`ckpt`, `./ckpt`, `/abs/ckpt`, through a link)."""
    return os.path.realpath(path)


_CHECKPOINT = "a checkpoint (a directory holding fsdpturbo.json or model/.metadata)"


def _is_checkpoint(directory):
    return os.path.isfile(os.path.join(directory, MANIFEST)) or \
        os.path.isfile(os.path.join(directory, "model", ".metadata"))


class _Save:
    """One save: its staging directory (its own, next to `path`) and how it ends. Each step
    that could fail on some ranks only is a collective step: every rank learns of a failure."""

    def __init__(self, path):
        self.path, self.staging, self.overwrite = path, None, False
        self.action = f"saving the checkpoint {path!r}"

    def start(self, extra, optimizer, overwrite):
        """Rank 0 checks `path`, serialises `extra` and creates the staging directory with the
        files it writes; every rank learns the staging directory."""
        self.overwrite = overwrite

        def prepare():
            if rank() != 0:
                return None
            extra_bytes = plain_bytes(_plain(extra), "extra")
            check_target(self.path, ours=_is_checkpoint, overwrite=overwrite, hint=_CHECKPOINT)
            staging = new_staging(self.path)
            try:
                os.mkdir(os.path.join(staging, "rng"))
                write_synced(os.path.join(staging, "extra.pt"), extra_bytes)
                write_synced(os.path.join(staging, MANIFEST), _manifest_bytes(extra, optimizer))
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            return staging

        self.staging = _on_every_rank(self.action, prepare)[0]

    def write_rng(self):
        file = os.path.join(self.staging, "rng", f"rank{rank()}.pt")
        _on_every_rank(self.action, lambda: write_synced(file, plain_bytes(_rng_state(), "the RNG states")))

    def finish(self):
        """Every rank's writes are done (DCP's save ends collectively): the staging directory
        replaces `path`."""
        def move():
            if rank() == 0:
                replace(self.staging, self.path, ours=_is_checkpoint, overwrite=self.overwrite, hint=_CHECKPOINT)

        _on_every_rank(self.action, move)

    def abandon(self):
        if rank() == 0 and self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)


def _manifest_bytes(extra, optimizer):
    step = (extra or {}).get("step")
    return json.dumps({"format": FORMAT, "version": _library_version(), "world_size": world_size(), "layout": _layout(),
                       "optimizer": optimizer is not None, "step": step if isinstance(step, int) else None},
                      indent=1).encode()


def save_checkpoint(model, optimizer, path, *, extra=None, async_save=False, overwrite=False):
    """Saves a training checkpoint of `model` (sharded by `shard_model` or any FSDP2/DTensor
    model) and `optimizer` (None: weights only) to the directory `path`. `extra`: a dict of
    tensors and plain values the caller gets back from `load_checkpoint`; values with a
    `state_dict()` (LR scheduler, data loader) are saved through it. Each rank's RNG states are
    saved too. Collective: a failure on any rank raises CheckpointError on every rank. The save
    is staged in a directory of its own next to `path` and an existing checkpoint at `path` is
    replaced only once the new one is complete and on disk; a `path` that holds anything but a
    checkpoint is not replaced (FileExistsError) unless `overwrite=True`. A save to a path with
    an asynchronous save pending first waits for it. With `async_save=True` the tensors are
    staged to CPU and written in the background: returns an `AsyncCheckpoint` whose `wait()`
    (collective) completes it; otherwise returns None when done."""
    path = normalised(path)
    pending = _PENDING.get(_pending_key(path))
    if pending is not None:
        logger.info("fsdpturbo: waiting for the asynchronous save to %r before saving there again", path)
        pending.wait()
    save = _Save(path)
    try:
        save.start(extra, optimizer, overwrite)
        states = {"model": get_model_state_dict(model, options=_OPTIONS)}
        if optimizer is not None:
            states["optimizer"] = get_optimizer_state_dict(model, optimizer, options=_OPTIONS)
        save.write_rng()
        if async_save:
            groups = _background_groups(len(states))
            futures = [dcp.async_save(state, checkpoint_id=os.path.join(save.staging, name), process_group=group,
                                      no_dist=not dist.is_initialized())
                       for (name, state), group in zip(states.items(), groups)]
            return AsyncCheckpoint(save, futures)
        total = sum(_tensor_bytes(s) for s in states.values())
        with Progress(total, f"saving {path}") as bar, dcp_failures(save.action):
            for name, state in states.items():
                dcp.save(state, checkpoint_id=os.path.join(save.staging, name), planner=_SavePlanner(bar),
                         no_dist=not dist.is_initialized())
        save.finish()
        return None
    except BaseException:
        save.abandon()
        raise


_BACKGROUND_GROUPS = []


def _background_groups(count):
    """One gloo group per concurrent background save: DCP's background thread runs collectives
    (the plan, the metadata) that must not interleave with each other's nor with training's
    on the default group. Created once, collectively, on the first asynchronous save."""
    if not dist.is_initialized():
        return [None] * count
    while len(_BACKGROUND_GROUPS) < count:
        _BACKGROUND_GROUPS.append(dist.new_group(backend="gloo"))
    return _BACKGROUND_GROUPS[:count]


def _library_version():
    from ._native import ops

    return ops.version()


def _resolve(path):
    """The checkpoint directory to read: `path`, or when a save was interrupted between its two
    renames, the previous checkpoint it had moved aside (`<path>.old`)."""
    path = normalised(path)
    if not os.path.isdir(path) and os.path.isfile(os.path.join(path + ".old", "model", ".metadata")):
        logger.warning("fsdpturbo: %s is missing; loading the previous checkpoint %s.old (a save was interrupted "
                       "while replacing it)", path, path)
        return path + ".old"
    if not os.path.isfile(os.path.join(path, "model", ".metadata")):
        what = "does not exist" if not os.path.exists(path) else "holds no model/.metadata"
        interrupted = glob.glob(glob.escape(path) + ".partial-*")
        hint = f" ({interrupted[0]} is an interrupted save)" if interrupted else ""
        raise FileNotFoundError(f"fsdpturbo: checkpoint {path!r} {what}{hint}; expected a directory written by "
                                f"fsdpturbo.save_checkpoint (model/ and optimizer/ DCP checkpoints)")
    return path


def _shape(value):
    from torch.distributed.tensor import DTensor

    return tuple(value.shape) if isinstance(value, (torch.Tensor, DTensor)) else None


def _check_against(state, directory, what):
    """Raises a clear error before any tensor is read when the DCP checkpoint `directory` cannot
    fill `state` (flattened names): a missing tensor, another global shape or dtype, a file
    shorter than the bytes its metadata promises (a truncated or partly copied checkpoint).
    Checkpoint tensors the state does not hold are logged."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = SafeFileSystemReader(directory).read_metadata()
    stored = metadata.state_dict_metadata
    flat, _ = flatten_state_dict(state)
    missing, wrong = [], []
    for name, value in flat.items():
        shape = _shape(value)
        if name not in stored:
            missing.append(name)
        elif shape is not None:
            entry = stored[name]
            if not isinstance(entry, TensorStorageMetadata):
                wrong.append(f"{name}: the checkpoint holds an object, the {what} a tensor of shape {list(shape)}")
            elif tuple(entry.size) != shape:
                wrong.append(f"{name}: the checkpoint has shape {list(entry.size)}, the {what} {list(shape)}")
            elif entry.properties.dtype != value.dtype:
                wrong.append(f"{name}: the checkpoint has dtype {entry.properties.dtype}, the {what} {value.dtype}")
    if missing or wrong:
        lines = wrong + ([f"missing from the checkpoint: {missing[:8]}" + (f" and {len(missing) - 8} more"
                                                                          if len(missing) > 8 else "")]
                         if missing else [])
        raise ValueError(f"fsdpturbo: the checkpoint {directory!r} does not match the {what} (a checkpoint of "
                         f"another model or configuration?):\n  " + "\n  ".join(lines))
    unused = sorted(set(stored) - set(flat))
    if unused:
        logger.info("fsdpturbo: %d tensors of %s are not used by the %s: %s", len(unused), directory, what, unused[:8])
    check_file_sizes(metadata, directory)


def check_file_sizes(metadata, directory):
    extents = {}
    for index, info in (metadata.storage_data or {}).items():
        extents.setdefault(info.relative_path, []).append((info.offset + info.length, index.fqn))
    for relative, ends in sorted(extents.items()):
        file = os.path.join(directory, relative)
        size = os.path.getsize(file) if os.path.isfile(file) else None
        cut = sorted((end, fqn) for end, fqn in ends if size is None or end > size)
        if cut:
            found = "is missing" if size is None else f"has {size} bytes"
            end, fqn = cut[0]
            more = f" (and {len(cut) - 1} more tensors)" if len(cut) > 1 else ""
            raise ValueError(f"fsdpturbo: checkpoint file {file!r} {found}, but its tensor {fqn!r} ends at byte "
                             f"{end}{more}: a truncated or partly copied checkpoint")


def _digest(file):
    with open(file, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def checkpoint_fingerprint(path):
    """What identifies the checkpoint at `path` for a cross-rank comparison: the SHA-256 of its
    model metadata, which names every tensor, shape and file with its byte ranges."""
    return {"model/.metadata sha256": _digest(os.path.join(_resolve(path), "model", ".metadata"))}


def _load(model, optimizer, path, restore_rng):
    """The collective read shared by both loads: every rank resolves and checks its copy (the
    files every part needs, `extra` and its RNG states read without code) in one collective
    step, the ranks must have read the same checkpoint (its metadata and `extra` digests), then
    DCP fills the states under one progress bar and they are set. Returns {"where": the
    directory read, "manifest", "extra": the saved extra, "rng": this rank's RNG states or
    None, "loaded": the names of the model state}."""
    fresh = optimizer is not None and not optimizer.state
    try:
        return _load_into(model, optimizer, path, restore_rng)
    except BaseException:
        if fresh:  # DCP's state dict initialised the moments (a step at lr 0): a refused load keeps none
            optimizer.state.clear()
        raise


def _load_into(model, optimizer, path, restore_rng):
    action = "loading the checkpoint"  # each rank's cause names its own path
    model_state = get_model_state_dict(model, options=_OPTIONS)
    optim_state = get_optimizer_state_dict(model, optimizer, options=_OPTIONS) if optimizer is not None else None
    found = {}

    def prepare():
        where = found["where"] = _resolve(path)
        manifest = found["manifest"] = _manifest(where)
        if optim_state is not None and not os.path.isfile(os.path.join(where, "optimizer", ".metadata")):
            raise ValueError(f"fsdpturbo: checkpoint {where!r} was saved without an optimizer; pass optimizer=None "
                             f"to load only the weights")
        parts = [(model_state, "model")] + ([(optim_state, "optimizer")] if optim_state is not None else [])
        for state, what in parts:
            _check_against(state, os.path.join(where, what), what)
        read = [os.path.join(what, ".metadata") for _, what in parts]
        found["extra"], found["rng"] = {}, None
        if manifest is not None:
            read.append("extra.pt")
            found["extra"] = load_plain(os.path.join(where, "extra.pt"), repr(os.path.join(where, "extra.pt")))
            if restore_rng and manifest.get("world_size") == world_size():
                rng = os.path.join(where, "rng", f"rank{rank()}.pt")
                found["rng"] = load_plain(rng, repr(rng))
        return {name: _digest(os.path.join(where, name)) for name in read}

    digests = _on_every_rank(action, prepare)
    check_same_on_every_rank({"checkpoint read (digests of its files)": digests[rank()]}, action)
    with Progress(sum(_tensor_bytes(s) for s in (model_state, optim_state) if s is not None),
                  f"loading {path}") as bar, dcp_failures(f"{action} {found['where']!r}"):
        for state, what in ((model_state, "model"), (optim_state, "optimizer")):
            if state is not None:
                dcp.load(state, storage_reader=SafeFileSystemReader(os.path.join(found["where"], what)),
                         planner=_LoadPlanner(bar), no_dist=not dist.is_initialized())
    set_model_state_dict(model, model_state, options=_OPTIONS)
    if optim_state is not None:
        set_optimizer_state_dict(model, optimizer, optim_state, options=_OPTIONS)
    found["loaded"] = list(model_state)
    return found


def load_model_weights(model, path):
    """Loads only the model weights of the checkpoint at `path` (this package's or
    LlamaFactory's) into `model`, at whatever layout `model` is sharded, and returns the names
    loaded (parameters and persistent buffers). Collective: a failure on any rank raises
    CheckpointError on every rank."""
    return _load(model, None, normalised(path), restore_rng=False)["loaded"]


def _manifest(path):
    """The manifest of a checkpoint this package saved; None for one LlamaFactory's fsdp2
    plugin saved (model/ and optimizer/ only)."""
    file = os.path.join(path, MANIFEST)
    if not os.path.isfile(file):
        return None
    with open(file, encoding="utf-8") as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"fsdpturbo: {path!r} has checkpoint format {manifest.get('format')!r}; this library reads "
                         f"{FORMAT!r}")
    return manifest


def load_checkpoint(model, optimizer, path, *, extra=None, restore_rng=True):
    """Loads the checkpoint at `path` into `model` and `optimizer` (None: weights only), at
    whatever layout they are sharded now, and returns the saved `extra` dict. Objects in the
    `extra` given here that have `load_state_dict` (scheduler, data loader) get their saved
    state loaded in place. A checkpoint of LlamaFactory's fsdp2 plugin (model/ and optimizer/
    only) loads too and returns {}. Each rank's RNG states are restored when the world size equals the
    saving one's (else a warning: there is no rank-to-rank correspondence). Errors name the
    tensor when the checkpoint does not fit the model (another model, shape, dtype) or a file
    is truncated; nothing is modified then. Collective: a failure on any rank, or ranks that
    read different checkpoints, raise on every rank."""
    path = normalised(path)
    found = _load(model, optimizer, path, restore_rng)
    saved, manifest = found["extra"], found["manifest"]
    for key, target in (extra or {}).items():
        if hasattr(target, "load_state_dict") and key in saved:
            target.load_state_dict(saved[key])
    if found["rng"] is not None:
        _set_rng_state(found["rng"])
    elif restore_rng and manifest is not None and rank() == 0:
        logger.warning("fsdpturbo: checkpoint %r was saved on %r ranks, this run has %d: RNG states are not "
                       "restored", found["where"], manifest.get("world_size"), world_size())
    return saved
