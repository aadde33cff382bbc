"""Offline conversion between training checkpoints (torch DCP) and Hugging Face safetensors,
on a CPU machine with no process group, one tensor at a time (peak memory about the largest
tensor), with a progress bar and a verifier:

    python -m fsdpturbo.convert to-hf CHECKPOINT OUT [--config HF_DIR] [--max-shard-size 4GB] [--fused] [--overwrite]
    python -m fsdpturbo.convert to-dcp HF_DIR OUT [--fused] [--overwrite]
    python -m fsdpturbo.convert verify OUT

CHECKPOINT is a directory of `fsdpturbo.save_checkpoint` or LlamaFactory (its `model/` is read)
or a bare DCP checkpoint. `to-hf` writes fused expert tensors in Hugging Face's per-expert layout
(`fsdpturbo.hf_layout`; `--fused` keeps them fused) plus the non-weight files (config, tokenizer)
of `--config` (default: those `to-dcp` kept in CHECKPOINT/hf_files). `to-dcp` writes OUT/model,
a weights-only checkpoint `load_checkpoint`, `dist_config.dcp_path` and `to-hf` read. Every
output holds `convert-manifest.json`: each tensor's dtype, shape and SHA-256 as written;
`verify` (run after every conversion unless `--no-verify`) re-reads every tensor and compares.
A round trip HF -> DCP -> HF gives every tensor back bitwise. OUT must be absent or empty
(`--overwrite` replaces it); the output is written and verified in a directory of its own and
renamed into place (`fsdpturbo.staging`), so a failed conversion leaves no output.
"""
import contextlib
import argparse
import hashlib
import json
import logging
import math
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from . import hf_layout
from .checkpoint import CheckpointError, check_file_sizes, dcp_failures
from .progress import Progress
from .safe_load import SafeFileSystemReader, SafeLoadPlanner
from .staging import check_target, new_staging, normalised, replace
from .weights import check_files, checkpoint_files

logger = logging.getLogger(__name__)

__all__ = ["dcp_to_hf", "hf_to_dcp", "verify"]

MANIFEST = "convert-manifest.json"
HF_FILES = "hf_files"
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
                       torch.float8_e5m2: "F8_E5M2"}
_TORCH_DTYPES = {name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()}


def _bytes(tensor):
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy()


def _digest(tensor):
    return hashlib.sha256(_bytes(tensor)).hexdigest()


def _entry(tensor):
    return {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape), "sha256": _digest(tensor)}


class _Entries:
    """Manifest entries computed on a thread of their own while the caller writes (hashing and
    file writes release the GIL), one tensor at a time so at most one extra tensor is held."""

    def __init__(self):
        self.entries, self._worker, self._pending = {}, ThreadPoolExecutor(1), None

    def add(self, name, tensor):
        self._collect()
        self._pending = (name, self._worker.submit(_entry, tensor))

    def _collect(self):
        if self._pending:
            name, future = self._pending
            self.entries[name] = future.result()
            self._pending = None

    def __enter__(self):
        return self

    def __exit__(self, *failure):
        if failure[0] is None:
            self._collect()
        self._worker.shutdown(wait=True, cancel_futures=True)


class _CachedReader(SafeFileSystemReader):
    """A DCP reader (metadata read without code) that reads the metadata once for the many
    one-tensor loads."""

    def read_metadata(self):
        if not hasattr(self, "_metadata"):
            self._metadata = super().read_metadata()
        return self._metadata


def _dcp_directory(path):
    path = os.fspath(path)
    for candidate in (os.path.join(path, "model"), path):
        if os.path.isfile(os.path.join(candidate, ".metadata")):
            return candidate
    raise FileNotFoundError(f"fsdpturbo convert: {path!r} is not a DCP checkpoint (no .metadata in it or in its "
                            f"model/ directory)")


class _DcpTensors:
    """The tensors of a DCP checkpoint, each read whole on its own."""

    def __init__(self, path):
        self.directory = _dcp_directory(path)
        self.reader = _CachedReader(self.directory)
        metadata = self.reader.read_metadata()
        check_file_sizes(metadata, self.directory)
        stored = metadata.state_dict_metadata
        self.meta = {k: v for k, v in sorted(stored.items()) if isinstance(v, TensorStorageMetadata)}
        skipped = sorted(set(stored) - set(self.meta))
        if skipped:
            logger.info("fsdpturbo convert: %d non-tensor entries are not converted: %s", len(skipped), skipped[:8])

    def read(self, name):
        meta = self.meta[name]
        tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
        with dcp_failures(f"reading {name!r} of {self.directory!r}"):
            dcp.load({name: tensor}, storage_reader=self.reader, planner=SafeLoadPlanner(), no_dist=True)
        return tensor


def _tied(config_dir):
    file = os.path.join(config_dir, "config.json") if config_dir else None
    if not file or not os.path.isfile(file):
        return False
    with open(file, encoding="utf-8") as f:
        return bool(json.load(f).get("tie_word_embeddings", False))


def _copy_hf_files(source, out):
    """The non-weight files of a Hugging Face directory (config, generation config, tokenizer)."""
    os.makedirs(out, exist_ok=True)
    for name in sorted(os.listdir(source)):
        if os.path.isfile(os.path.join(source, name)) and not name.endswith(".safetensors") \
                and name != "model.safetensors.index.json":
            shutil.copy2(os.path.join(source, name), os.path.join(out, name))


def _nothing(_):
    return False


@contextlib.contextmanager
def _staged(out, overwrite):
    """A directory of its own to write the output in, renamed to `out` when the block succeeds,
    deleted when it fails. `out` must be absent or empty unless `overwrite`."""
    out = normalised(out)
    check_target(out, ours=_nothing, overwrite=overwrite, hint="empty")
    staging = new_staging(out)
    try:
        yield staging
        replace(staging, out, ours=_nothing, overwrite=overwrite, hint="empty")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _write_manifest(out, direction, source, tensors):
    with open(os.path.join(out, MANIFEST), "w", encoding="utf-8") as f:
        json.dump({"direction": direction, "source": os.path.abspath(source), "tensors": tensors}, f, indent=1)


def _plan_files(entries, max_shard_bytes):
    """Splits (key, dtype, shape, nbytes) entries, in order, into safetensors files of at most
    `max_shard_bytes` of data (a larger tensor gets a file of its own)."""
    files, current, size = [], [], 0
    for entry in entries:
        if current and size + entry[3] > max_shard_bytes:
            files.append(current)
            current, size = [], 0
        current.append(entry)
        size += entry[3]
    if current:
        files.append(current)
    return files


def _header(entries):
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for key, dtype, shape, nbytes in entries:
        header[key] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def dcp_to_hf(checkpoint, out, *, config=None, max_shard_bytes=4 << 30, per_expert=True, check=True,
              overwrite=False):
    """Writes the model tensors of the DCP `checkpoint` as a Hugging Face safetensors directory
    `out`; returns the number of tensors written. See the module docstring."""
    source = _DcpTensors(checkpoint)
    with _staged(out, overwrite) as staging:
        return _write_hf(source, checkpoint, staging, config, max_shard_bytes, per_expert, check)


def _write_hf(source, checkpoint, out, config, max_shard_bytes, per_expert, check):
    kept = os.path.join(os.fspath(checkpoint), HF_FILES)
    config = config or (kept if os.path.isdir(kept) else None)
    tied = _tied(config)
    names = [n for n in source.meta if not (tied and n == "lm_head.weight")]

    def pieces(name, tensor):
        return hf_layout.split(name, tensor) if per_expert else [(name, tensor)]

    entries, owner = [], {}
    for name in names:
        meta = source.meta[name]
        dtype = meta.properties.dtype
        if dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"fsdpturbo convert: {name!r} has dtype {dtype}, which safetensors cannot hold")
        for key, piece in pieces(name, torch.empty(meta.size, dtype=dtype, device="meta")):
            entries.append((key, dtype, tuple(piece.shape), piece.numel() * dtype.itemsize))
            owner[key] = name
    files = _plan_files(entries, max_shard_bytes)
    file_names = ["model.safetensors"] if len(files) == 1 else \
        [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    if config:
        _copy_hf_files(config, out)
    held, total = (None, None), sum(e[3] for e in entries)
    with _Entries() as tensors, Progress(total, f"converting {source.directory} to {out}") as bar:
        for file_name, file_entries in zip(file_names, files):
            with open(os.path.join(out, file_name), "wb") as f:
                f.write(_header(file_entries))
                for key, _, _, nbytes in file_entries:
                    name = owner[key]
                    if held[0] != name:
                        held = (name, dict(pieces(name, source.read(name))))
                    piece = held[1][key]
                    tensors.add(key, piece)
                    f.write(_bytes(piece))
                    bar.update(nbytes)
    if len(files) > 1:
        with open(os.path.join(out, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": sum(e[3] for e in entries)},
                       "weight_map": {e[0]: n for n, fe in zip(file_names, files) for e in fe}}, f, indent=2)
    _write_manifest(out, "to-hf", checkpoint, tensors.entries)
    if check:
        verify(out)
    return len(tensors.entries)


class _LazySavePlanner(DefaultSavePlanner):
    """Plans from meta tensors and reads each real tensor only when the writer asks for it,
    recording its manifest entry."""

    def __init__(self, produce, bar, tensors):
        super().__init__()
        self.produce, self.bar, self.tensors = produce, bar, tensors

    def resolve_data(self, write_item):
        name = write_item.index.fqn
        tensor = self.produce(name)
        self.tensors.add(name, tensor)
        self.bar.update(tensor.numel() * tensor.element_size())
        return tensor


def hf_to_dcp(hf_dir, out, *, per_expert=True, check=True, overwrite=False):
    """Writes the Hugging Face safetensors checkpoint `hf_dir` as the DCP checkpoint OUT/model
    (per-expert weights fused unless `per_expert=False`); returns the number of tensors."""
    with _staged(out, overwrite) as staging:
        return _write_dcp(hf_dir, staging, per_expert, check)


def _write_dcp(hf_dir, out, per_expert, check):
    from safetensors import safe_open

    check_files(hf_dir)
    handles = [safe_open(f, framework="pt") for f in checkpoint_files(hf_dir)]
    where = {key: h for h in handles for key in h.keys()}
    sources = hf_layout.fuse(list(where)) if per_expert else {k: k for k in where}
    hf_config = hf_dir if os.path.isdir(hf_dir) else None
    if _tied(hf_config) and "lm_head.weight" not in sources and "model.embed_tokens.weight" in sources:
        sources["lm_head.weight"] = "model.embed_tokens.weight"  # the model's state dict names both

    def read(key):
        return where[key].get_tensor(key)

    def produce(name):
        rows = sources[name]
        return read(rows) if isinstance(rows, str) else hf_layout.stack(rows, read)

    def shape_and_dtype(key):
        view = where[key].get_slice(key)
        return list(view.get_shape()), _TORCH_DTYPES[view.get_dtype()]

    def meta(name):
        rows = sources[name]
        if isinstance(rows, str):
            shape, dtype = shape_and_dtype(rows)
        else:  # [E, sum of the parts' rows, ...]
            parts = [shape_and_dtype(key) for key in rows[0]]
            shape, dtype = [len(rows), sum(p[0][0] for p in parts)] + parts[0][0][1:], parts[0][1]
        return torch.empty(shape, dtype=dtype, device="meta")

    state = {name: meta(name) for name in sorted(sources)}
    directory = os.path.join(out, "model")
    total = sum(t.numel() * t.element_size() for t in state.values())
    with _Entries() as tensors, Progress(total, f"converting {hf_dir} to {out}") as bar:
        # A file per tensor: DCP's writer holds every tensor of a file until the file is done.
        # The staged output is synced as a whole before its rename, not a file at a time.
        writer = FileSystemWriter(directory, single_file_per_rank=False, thread_count=1, sync_files=False)
        dcp.save(state, storage_writer=writer,
                 planner=_LazySavePlanner(produce, bar, tensors), no_dist=True)
    if hf_config:
        _copy_hf_files(hf_config, os.path.join(out, HF_FILES))
    _write_manifest(out, "to-dcp", hf_dir, tensors.entries)
    if check:
        verify(out)
    return len(tensors.entries)


_TORCH_DTYPE_NAMES = {str(dtype).removeprefix("torch."): dtype for dtype in _SAFETENSORS_DTYPES}


def _read_manifest(out):
    """The manifest of the conversion output `out`, checked to be one `_write_manifest` wrote;
    ValueError naming what is wrong otherwise."""
    file = os.path.join(out, MANIFEST)
    try:
        with open(file, encoding="utf-8") as f:
            manifest = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"fsdpturbo convert: {file!r} is not a conversion manifest: {e}") from None

    def entry_problem(entry):
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "sha256"}:
            return "is not {dtype, shape, sha256}"
        if entry["dtype"] not in _TORCH_DTYPE_NAMES:
            return f"has dtype {entry['dtype']!r}; accepted: {sorted(_TORCH_DTYPE_NAMES)}"
        if not isinstance(entry["shape"], list) or not all(type(n) is int and n >= 0 for n in entry["shape"]):
            return f"has shape {entry['shape']!r}, not a list of sizes"
        return None

    if not isinstance(manifest, dict) or manifest.get("direction") not in ("to-hf", "to-dcp") \
            or not isinstance(manifest.get("tensors"), dict):
        raise ValueError(f"fsdpturbo convert: {file!r} is not a conversion manifest: it needs a direction "
                         f"('to-hf' or 'to-dcp') and a tensors object")
    for name, entry in manifest["tensors"].items():
        problem = entry_problem(entry)
        if problem:
            raise ValueError(f"fsdpturbo convert: {file!r}: the entry of {name!r} {problem}")
    return manifest


def verify(out):
    """Re-reads every tensor of a conversion output and compares dtype, shape and SHA-256 with
    its manifest; raises ValueError naming the first tensor that differs. Returns the count."""
    from safetensors import safe_open

    manifest = _read_manifest(out)
    expected = manifest["tensors"]
    if manifest["direction"] == "to-dcp":
        source = _DcpTensors(out)
        found, read = set(source.meta), source.read
    else:
        check_files(out)
        handles = [safe_open(f, framework="pt") for f in checkpoint_files(out)]
        where = {key: h for h in handles for key in h.keys()}
        found, read = set(where), lambda key: where[key].get_tensor(key)
    if found != set(expected):
        raise ValueError(f"fsdpturbo convert: {out!r} holds other tensors than its manifest: missing "
                         f"{sorted(set(expected) - found)[:8]}, unexpected {sorted(found - set(expected))[:8]}")
    total = sum(math.prod(e["shape"]) * _TORCH_DTYPE_NAMES[e["dtype"]].itemsize for e in expected.values())
    with Progress(total, f"verifying {out}") as bar:
        for name in sorted(expected):
            tensor = read(name)
            got = _entry(tensor)
            if got != expected[name]:
                raise ValueError(f"fsdpturbo convert: {name!r} in {out!r} does not match the manifest: read {got}, "
                                 f"written {expected[name]}")
            bar.update(tensor.numel() * tensor.element_size())
    return len(expected)


def _size(text):
    units = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}
    upper = text.strip().upper()
    for unit, factor in units.items():
        if upper.endswith(unit):
            return int(float(upper[:-2]) * factor)
    if upper.isdigit():
        return int(upper)
    raise argparse.ArgumentTypeError(f"{text!r} is not a size; give bytes or a number with KB, MB, GB or TB")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m fsdpturbo.convert", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    to_hf = commands.add_parser("to-hf", help="DCP checkpoint -> Hugging Face safetensors")
    to_hf.add_argument("checkpoint")
    to_hf.add_argument("out")
    to_hf.add_argument("--config", help="a Hugging Face directory whose config and tokenizer files to copy")
    to_hf.add_argument("--max-shard-size", type=_size, default=4 << 30)
    to_dcp = commands.add_parser("to-dcp", help="Hugging Face safetensors -> DCP checkpoint")
    to_dcp.add_argument("hf_dir")
    to_dcp.add_argument("out")
    for command in (to_hf, to_dcp):
        command.add_argument("--fused", action="store_true", help="keep expert tensors as stored (no per-expert "
                                                                  "split or fusion)")
        command.add_argument("--no-verify", action="store_true")
        command.add_argument("--overwrite", action="store_true", help="replace OUT when it is not empty")
    check = commands.add_parser("verify", help="re-read a conversion output against its manifest")
    check.add_argument("out")
    args = parser.parse_args(argv)
    try:
        if args.command == "to-hf":
            n = dcp_to_hf(args.checkpoint, args.out, config=args.config, max_shard_bytes=args.max_shard_size,
                          per_expert=not args.fused, check=not args.no_verify, overwrite=args.overwrite)
        elif args.command == "to-dcp":
            n = hf_to_dcp(args.hf_dir, args.out, per_expert=not args.fused, check=not args.no_verify,
                          overwrite=args.overwrite)
        else:
            n = verify(args.out)
    except (OSError, ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{args.command}: {n} tensors" + ("" if args.command == "verify" or args.no_verify else ", verified"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
