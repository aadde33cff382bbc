"""Reading checkpoint files without running code from them.

A pickle names functions for `pickle.load` to call, so a checkpoint from someone else would be
code. Every pickle a checkpoint load or a conversion reads goes through here: plain values and
tensors with `torch.load(weights_only=True)`, DCP's `.metadata` with an unpickler that resolves
only DCP's own metadata types, and DCP's non-tensor entries (an optimizer's param groups) with a
load planner that reads them with weights_only=True. A file naming anything else is refused
with a ValueError naming the file and what it names.
"""
import io
import pickle
import re

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

__all__ = ["SafeFileSystemReader", "SafeLoadPlanner", "load_plain", "plain_bytes"]

_METADATA_TYPES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "BytesStorageMetadata", "ChunkStorageMetadata", "Metadata", "MetadataIndex", "StorageMeta",
        "TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # storage_meta.checkpoint_id
    ("pathlib._local", "PosixPath"), ("pathlib._local", "PurePosixPath"),  # Python >= 3.13
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, name):
        super().__init__(file)
        self.name = name

    def find_class(self, module, name):
        if (module, name) in _METADATA_TYPES or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                 torch.dtype)):
            return super().find_class(module, name)
        raise ValueError(f"fsdpturbo: {self.name!r} names {module}.{name}, which is not one of DCP's metadata "
                         f"types: refused, loading it would run code from the file")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file system reader, reading `.metadata` through the allowlist of DCP's own types."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream, str(path)).load()
        if not isinstance(metadata, Metadata):
            raise ValueError(f"fsdpturbo: {str(path)!r} holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _refusal(name, error):
    """The ValueError for a file torch's weights-only unpickler refused, naming what it names."""
    found = re.search(r"GLOBAL (\S+)", str(error)) or re.search(r"(Trying to [^\n]{,200}|WeightsUnpickler error: "
                                                                 r"[^\n]{,200})", str(error))
    what = found[1] if found else "what torch's weights-only loader refuses"
    return ValueError(f"fsdpturbo: {name} holds {what}, not only tensors and plain values (dict, list, tuple, "
                      f"str, int, float, bool, None): refused, loading it would run code from the file")


def load_plain(file_or_buffer, name):
    """Tensors and plain values from a `torch.save` file (or buffer) called `name` in errors."""
    try:
        return torch.load(file_or_buffer, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise _refusal(name, e) from None


def plain_bytes(value, name):
    """`value` serialised by `torch.save`, checked to load back through `load_plain` (a value
    that would need code to load is refused now, not when the checkpoint is read)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    load_plain(io.BytesIO(buffer.getvalue()), name)
    return buffer.getvalue()


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor entries with weights_only=True."""

    def load_bytes(self, read_item, value):
        loaded = load_plain(value, f"the DCP entry {read_item.dest_index.fqn!r}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
