"""Replacing members of a model's modules (the seed's `fsdp_turbo.utils.patch`), e.g. HF's
`self.chunk_gated_delta_rule = fla_fn` attribute of every linear-attention layer by a kernel.

`patch_model_members(model, targets, replacements) -> int`:

* `targets`: one or more `"module.Class.member"` paths; `replacements`: one callable or dotted
  path `"package.module.function"` for all targets, or one per target.
* Every module of `model.named_modules()` that is an instance of the class (subclasses
  included) is counted, and its member replaced:
  - a property: a new property with the replacement as getter (setter, deleter and doc kept) on
    the class in the MRO that defines it (so it applies to all instances of that class);
  - a bound method (or classmethod): the replacement bound to the same receiver, set as an
    instance attribute;
  - any other callable (a plain function stored on the instance, as HF does for the FLA
    kernels): the replacement itself, unbound, set as an instance attribute.
* Idempotent: applying the same replacement object again installs nothing but still counts the
  module; a new object (e.g. a new `functools.partial`) is installed again.
* Returns the number of matched modules over all targets.

`apply_module_patch(model, target, replacement) -> int` (FSDPTurbo's `module_patches` entry):
a `target` naming a module-level callable (`"package.module.function"`) is replaced in its
module and in every loaded module that holds it under a name of its own (`from m import f`),
once per replacement (1 match); any other target is a `patch_model_members` target.

The error texts are the seed's.
"""
import importlib
import inspect
import sys
import types

__all__ = ["PATCH_IDS_ATTR", "apply_module_patch", "callable_id", "import_module_or_suffix", "patch_model_members",
           "resolve_callable", "resolve_class_member"]

PATCH_IDS_ATTR = "_fsdp_turbo_patch_ids"


def _as_list(x):
    if x is None:
        return []
    if isinstance(x, (str, bytes, dict)) or callable(x):
        return [x]
    return list(x)


def _expand_pairs(targets, replacements):
    targets, replacements = _as_list(targets), _as_list(replacements)
    if not targets:
        raise ValueError("targets must not be empty.")
    if len(replacements) == 1:
        replacements = replacements * len(targets)
    elif len(replacements) != len(targets):
        raise ValueError("replacements must contain either 1 item or the same number of items as targets.")
    return list(zip(targets, replacements))


def import_module_or_suffix(module_path):
    """Imports `a.b.c`, else `b.c`, else `c` (a path written relative to a package root). A
    ModuleNotFoundError raised for something the candidate itself imports is re-raised."""
    parts = module_path.split(".")
    for i in range(len(parts)):
        candidate = ".".join(parts[i:])
        try:
            return importlib.import_module(candidate)
        except ModuleNotFoundError as e:
            missing = e.name or ""
            if not (candidate == missing or candidate.startswith(missing + ".")):
                raise
    raise ModuleNotFoundError(f"No module named {module_path!r}.", name=module_path)


def resolve_callable(replacement):
    """A callable as is; a dotted path `"package.module.function"` imported (with the suffix
    retry of `import_module_or_suffix`)."""
    if callable(replacement):
        return replacement
    if not isinstance(replacement, str):
        raise TypeError(f"A replacement must be a callable or a dotted callable path string, got "
                        f"{type(replacement).__name__} ({replacement!r}).")
    path = replacement
    if ":" in path:
        raise ValueError(f"Use dotted callable paths, not colon paths: {path!r}.")
    if "." not in path:
        raise ValueError(f"Invalid callable path {path!r}.")
    module_path, attr = path.rsplit(".", 1)
    module = import_module_or_suffix(module_path)
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise AttributeError(f"Module {module.__name__!r} has no attribute {attr!r} (callable path "
                             f"{path!r}).") from None
    if not callable(obj):
        raise TypeError(f"Resolved object {path!r} is not callable.")
    return obj


def resolve_class_member(path):
    """`"module.Class.member"` -> (the class, "member")."""
    if not isinstance(path, str):
        raise TypeError(f"A target must be a 'module.Class.member' string, got {type(path).__name__} ({path!r}).")
    if "." not in path:
        raise ValueError(f"Invalid class member path {path!r}.")
    class_path, member = path.rsplit(".", 1)
    if "." not in class_path:
        raise ValueError(f"Invalid class member path {path!r}; use 'module.Class.member'.")
    module_path, class_name = class_path.rsplit(".", 1)
    module = importlib.import_module(module_path)
    try:
        cls = getattr(module, class_name)
    except AttributeError:
        raise AttributeError(f"Module {module_path!r} has no class {class_name!r} (target {path!r}).") from None
    if not isinstance(cls, type):
        raise TypeError(f"Resolved class {class_path!r} is not a type.")
    return cls, member


def callable_id(fn):
    """The identity a patch records: (module, qualified name, id) of the function (of the
    underlying function for a bound method)."""
    fn = getattr(fn, "__func__", fn)
    module = getattr(fn, "__module__", None) or type(fn).__module__
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return (module, qualname, id(fn))


def _patch_ids(installed):
    holder = installed.fget if isinstance(installed, property) else installed
    return getattr(holder, PATCH_IDS_ATTR, ())


def _install(owner, name, original, installed, replacement):
    """Sets `owner.name = installed` unless `replacement` is what is installed already."""
    pid = callable_id(replacement)
    if pid in _patch_ids(original):
        return False
    try:
        setattr(replacement, PATCH_IDS_ATTR, (pid,))
    except (AttributeError, TypeError):
        # A builtin without a __dict__ cannot carry the mark: compare by identity instead.
        current = original.fget if isinstance(original, property) else getattr(original, "__func__", original)
        if current is replacement:
            return False
    setattr(owner, name, installed)
    return True


def _patch_member(module, name, replacement, target):
    try:
        raw = inspect.getattr_static(module, name)
    except AttributeError:
        raise AttributeError(f"Target member {target!r}: {type(module).__qualname__} has no attribute "
                             f"{name!r}.") from None
    if isinstance(raw, property):
        owner = next(k for k in type(module).__mro__ if name in vars(k))
        if raw.fget is None:
            raise TypeError(f"Cannot patch write-only property {owner.__module__}.{owner.__qualname__}.{name}.")
        new = property(replacement, raw.fset, raw.fdel, raw.__doc__)
        return _install(owner, name, raw, new, replacement)
    original = getattr(module, name)
    if not callable(original):
        raise TypeError(f"Target member {target!r} is neither a property nor a callable.")
    receiver = getattr(original, "__self__", None)
    if receiver is module or isinstance(receiver, type):
        installed = types.MethodType(replacement, receiver)
    else:
        installed = replacement
    return _install(module, name, original, installed, replacement)


def patch_model_members(model, targets, replacements):
    """Replaces `targets` ("module.Class.member") on every matching module of `model` by
    `replacements`; returns the number of matched modules. See the module docstring."""
    matched = 0
    for target, replacement in _expand_pairs(targets, replacements):
        fn = resolve_callable(replacement)
        cls, member = resolve_class_member(target)
        for _, module in model.named_modules():
            if isinstance(module, cls):
                matched += 1
                _patch_member(module, member, fn, target)
    return matched


def _module_member(path):
    """(module, name) when `path` names a callable at module level, else None."""
    owner_path, _, name = path.rpartition(".")
    if not owner_path:
        return None
    try:
        owner = import_module_or_suffix(owner_path)
    except ModuleNotFoundError:
        return None
    return (owner, name) if callable(getattr(owner, name, None)) else None


def _patch_module_member(owner, name, replacement):
    original = getattr(owner, name)
    if not _install(owner, name, original, replacement, replacement):
        return
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None) or {}
        for alias, value in list(namespace.items()):
            if value is original:
                namespace[alias] = replacement


def apply_module_patch(model, target, replacement):
    """Replaces `target` by `replacement` (see the module docstring); returns the number of
    matches (0: `target` matched nothing, left to the caller to refuse)."""
    member = _module_member(target) if isinstance(target, str) else None
    if member is None:
        return patch_model_members(model, target, replacement)
    _patch_module_member(*member, resolve_callable(replacement))
    return 1
