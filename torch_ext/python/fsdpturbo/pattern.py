"""The seed's module-name pattern language (`{*}`, `{a-b}`, `*`, `?`, anchored), compiled and
matched by the Rust core."""
import ctypes

from ._native import check, lib


class Pattern:
    """A compiled pattern: compile once, match many names."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        handle = ctypes.c_void_p()
        check(lib.fsdpturbo_pattern_compile(pattern.encode(), ctypes.byref(handle)))
        self._handle = handle

    def __del__(self):
        if getattr(self, "_handle", None):
            lib.fsdpturbo_pattern_free(self._handle)

    def match(self, name: str) -> bool:
        out = ctypes.c_bool(False)
        check(lib.fsdpturbo_pattern_match(self._handle, name.encode(), ctypes.byref(out)))
        return out.value

    def __repr__(self):
        return f"Pattern({self.pattern!r})"


def module_name_match(pattern: str, name: str) -> bool:
    """Whether module `name` matches `pattern`. Raises ValueError with the seed's text for a
    malformed brace group."""
    out = ctypes.c_bool(False)
    check(lib.fsdpturbo_module_name_match(pattern.encode(), name.encode(), ctypes.byref(out)))
    return out.value


def match_modules(model, patterns, error_prefix, plan_repr):
    """The seed's module selection: for each pattern (outer), every matching module in
    `named_modules()` order; a module matched twice is kept once. No match at all raises the
    seed's RuntimeError, `{error_prefix} No module named {plan} or not be ModuleList`."""
    compiled = [Pattern(p) for p in patterns]
    named = list(model.named_modules())
    matched, seen = [], set()
    for pattern in compiled:
        for name, module in named:
            if id(module) not in seen and pattern.match(name):
                seen.add(id(module))
                matched.append((name, module))
    if not matched:
        raise RuntimeError(f"{error_prefix} No module named {plan_repr} or not be ModuleList")
    return matched
