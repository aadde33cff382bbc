"""Which models take sequence chunks, on which group. The patched functions are process-wide
(a module-level attention function) or shared by a class's instances, so they act only for
the modules of an attached model and call the original everywhere else: a one-process
reference model in the same process, or a model built at another CP size, is unaffected."""
import weakref

import torch.distributed as dist

__all__ = ["attach", "group_of"]

_GROUPS = weakref.WeakKeyDictionary()  # module -> its model's Ulysses group
_HOOKS = weakref.WeakKeyDictionary()  # attached model -> its input check's hook handle


def attach(model, group, check_inputs=None):
    """Every module of `model` takes this rank's chunk of each sequence and works with the
    other ranks of `group` (its Ulysses group); attaching again replaces the group.
    `check_inputs(kwargs)`, when given, runs before each forward of `model` on its keyword
    arguments (to refuse inputs that chunks cannot take)."""
    for module in model.modules():
        _GROUPS[module] = group
    handle = _HOOKS.pop(model, None)
    if handle is not None:
        handle.remove()
    if check_inputs is not None:
        _HOOKS[model] = model.register_forward_pre_hook(lambda module, args, kwargs: check_inputs(kwargs),
                                                        with_kwargs=True)
    return model


def group_of(module):
    """The Ulysses group of `module`'s attached model, or None (not attached, or a group of
    one rank: nothing to split)."""
    group = _GROUPS.get(module)
    return group if group is not None and dist.get_world_size(group) > 1 else None
