"""`module_name_match`: the seed's module-name pattern language, matched by the Rust core."""
import ctypes

from ._native import check, lib


def module_name_match(pattern: str, name: str) -> bool:
    """Whether module `name` matches `pattern` (`{*}`, `{a-b}`, `*`, `?`, anchored).

    Raises ValueError with the seed's text for a malformed brace group."""
    out = ctypes.c_bool(False)
    check(lib.fsdpturbo_module_name_match(pattern.encode(), name.encode(), ctypes.byref(out)))
    return out.value
