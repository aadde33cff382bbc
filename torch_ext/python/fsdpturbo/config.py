"""The strict training configuration, parsed and validated by the Rust core."""
import ctypes
import json
import os

from ._native import check, lib, string_out


def parse_train_config(source) -> dict:
    """Parses a LlamaFactory-style training YAML (a path, YAML text, or a dict) and returns the
    validated configuration as a dict with every default filled in. Every violation, with its
    YAML path and line, is reported in one ValueError."""
    if isinstance(source, dict):
        text = json.dumps(source)
    elif isinstance(source, (str, os.PathLike)) and os.path.isfile(source):
        with open(source, encoding="utf-8", errors="surrogateescape") as f:
            text = f.read()
    else:
        text = str(source)
    data = text.encode("utf-8", errors="surrogateescape")
    handle = ctypes.c_void_p()
    check(lib.fsdpturbo_config_parse(data, len(data), ctypes.byref(handle)))
    try:
        return json.loads(string_out(lib.fsdpturbo_config_to_json, handle))
    finally:
        lib.fsdpturbo_config_free(handle)
