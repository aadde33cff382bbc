"""The strict training configuration, parsed and validated by the Rust core."""
import contextlib
import copy
import ctypes
import json
import os

from ._native import check, lib, string_out


def _parse(source):
    """A new configuration handle (fsdpturbo_config_t) of `source`: a path, YAML text or a dict."""
    if isinstance(source, dict):
        text = json.dumps(source)
    elif isinstance(source, (str, os.PathLike)) and os.path.isfile(source):
        with open(source, encoding="utf-8", errors="surrogateescape") as f:
            text = f.read()
    elif isinstance(source, os.PathLike) or (isinstance(source, str) and source.strip()
                                              and "\n" not in source and ":" not in source):
        raise FileNotFoundError(f"fsdpturbo: the training configuration {os.fspath(source)!r} does not exist "
                                f"(expected a YAML file, YAML text or a dict)")
    else:
        text = str(source)
    data = text.encode("utf-8", errors="surrogateescape")
    handle = ctypes.c_void_p()
    check(lib.fsdpturbo_config_parse(data, len(data), ctypes.byref(handle)))
    return handle


class TrainConfig:
    """A training configuration parsed and validated once: its handle in the Rust core (what
    the plan resolution reads) and `values`, the validated dict with every default filled in.
    `shard_model` makes one and hands it to the parallel state and the plan."""

    def __init__(self, source):
        self._handle = _parse(source)
        self.values = json.loads(string_out(lib.fsdpturbo_config_to_json, self._handle))

    @classmethod
    def of(cls, source):
        """`source` itself when it is a TrainConfig, else it parsed."""
        return source if isinstance(source, cls) else cls(source)

    def __del__(self):
        if getattr(self, "_handle", None):
            lib.fsdpturbo_config_free(self._handle)


@contextlib.contextmanager
def config_handle(source):
    """The parsed configuration handle (fsdpturbo_config_t) of `source` (a `TrainConfig`, kept;
    or a path, YAML text or a dict, parsed and freed on exit). Every violation raises one
    ValueError; a path (a PathLike, or a string of one line without ':') that names no file
    raises FileNotFoundError."""
    if isinstance(source, TrainConfig):
        yield source._handle
        return
    handle = _parse(source)
    try:
        yield handle
    finally:
        lib.fsdpturbo_config_free(handle)


def parse_train_config(source) -> dict:
    """Parses a LlamaFactory-style training YAML (a path, YAML text, or a dict) and returns the
    validated configuration as a dict with every default filled in (of a `TrainConfig`: a copy
    of its values). Every violation, with its YAML path and line, is reported in one ValueError."""
    if isinstance(source, TrainConfig):
        return copy.deepcopy(source.values)
    return TrainConfig(source).values
