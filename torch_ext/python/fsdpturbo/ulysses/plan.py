"""A context-parallel plan (`cp_plan`: `ulysses_function_patches` and `loss_function_patches`,
each a list of `{"target_functions": [dotted paths], "type": name}`) installed on one model.

* `ulysses_function_patches`: each target (a module-level function, e.g. a modeling file's
  `eager_attention_forward`, or a class member `"module.Class.forward"`) is wrapped by its
  type's Ulysses version (`FUNCTION_TYPES`), which acts for the attached model's modules only.
  A target already wrapped is kept (a second model, e.g. verl's reference then actor engine).
* `loss_function_patches`: each target must be the model's own loss function
  (`model.loss_function`, e.g. `transformers.loss.loss_utils.ForCausalLMLoss`); the model's
  loss becomes its chunk-aware version (`LOSS_TYPES`), for this model only.

The model is then attached to the Ulysses group. At each forward it needs the position ids
of its chunk (without them every chunk would count positions from 0), and labels only when a
loss patch shifts them across the chunks.
"""
from fsdpturbo.patch import apply_module_patch, current_target

from .attention import full_attention
from .gated_delta_net import gated_delta_net
from .loss import causal_lm_loss
from .model import attach

__all__ = ["FUNCTION_TYPES", "LOSS_TYPES", "apply_cp_plan", "entry_problems"]

FUNCTION_TYPES = {"full_attention": full_attention, "gated_delta_net": gated_delta_net}
LOSS_TYPES = {"causal_lm_loss": causal_lm_loss}
_FIELDS = {"ulysses_function_patches": FUNCTION_TYPES, "loss_function_patches": LOSS_TYPES}
_WRAPPED = "_fsdpturbo_ulysses"


def entry_problems(cp_plan, path="distributed.cp_plan"):
    """The problems of `cp_plan`'s entries' form (each names its path and what is accepted)."""
    problems = []
    for field, types in _FIELDS.items():
        entries = getattr(cp_plan, field)
        if not isinstance(entries, (list, tuple)):
            problems.append(f"{path}.{field}: expected a list of {{'target_functions': [dotted paths], 'type': "
                            f"name}}, got {entries!r}")
            continue
        for i, entry in enumerate(entries):
            where = f"{path}.{field}[{i}]"
            if not isinstance(entry, dict) or set(entry) != {"target_functions", "type"}:
                problems.append(f"{where}: expected {{'target_functions': [dotted paths], 'type': name}}, got {entry!r}")
                continue
            targets = entry["target_functions"]
            if not (isinstance(targets, (list, tuple)) and targets and all(isinstance(t, str) for t in targets)):
                problems.append(f"{where}.target_functions: expected a non-empty list of dotted paths, got {targets!r}")
            if entry["type"] not in types:
                problems.append(f"{where}.type: {entry['type']!r} is no {field} type; accepted: {', '.join(types)}")
    return problems


def _wrapped(target, wrap):
    """The Ulysses version of what `target` names now (itself when it is one already)."""
    original = current_target(target)
    if getattr(original, _WRAPPED, False):
        return original
    replacement = wrap(original)
    setattr(replacement, _WRAPPED, True)
    return replacement


def _loss_of(model):
    loss = model.loss_function
    return getattr(loss, "__wrapped__", loss) if getattr(loss, _WRAPPED, False) else loss


def apply_cp_plan(model, group, cp_plan, path="distributed.cp_plan"):
    """Installs `cp_plan` (its entries' form checked by `entry_problems`) on `model` and attaches
    it to `group`; returns the problems found (each names its entry's path), [] when installed."""
    problems = []
    for i, entry in enumerate(cp_plan.ulysses_function_patches):
        for j, target in enumerate(entry["target_functions"]):
            where = f"{path}.ulysses_function_patches[{i}].target_functions[{j}]"
            try:
                replacement = _wrapped(target, FUNCTION_TYPES[entry["type"]])
            except (ImportError, AttributeError, TypeError, ValueError) as error:
                problems.append(f"{where}: {target!r} cannot be resolved ({error}); accepted: a module-level "
                                f"function or a 'module.Class.member'")
                continue
            if not apply_module_patch(model, target, replacement):
                problems.append(f"{where}: {target!r} is a member of no class of {type(model).__name__}'s modules")
    for i, entry in enumerate(cp_plan.loss_function_patches):
        for j, target in enumerate(entry["target_functions"]):
            where = f"{path}.loss_function_patches[{i}].target_functions[{j}]"
            try:
                original = current_target(target)
            except (ImportError, AttributeError, TypeError, ValueError) as error:
                problems.append(f"{where}: {target!r} cannot be resolved ({error})")
                continue
            if _loss_of(model) is not original:
                problems.append(f"{where}: {target!r} is not the loss function of {type(model).__name__} (it uses "
                                f"{_loss_of(model).__module__}.{_loss_of(model).__qualname__}); accepted: the "
                                f"model's loss function")
                continue
            loss = LOSS_TYPES[entry["type"]](original, group)
            setattr(loss, _WRAPPED, True)
            model.loss_function = loss
    if problems:
        return problems
    chunked_labels = bool(cp_plan.loss_function_patches)
    attach(model, group, lambda kwargs: _check_inputs(kwargs, chunked_labels))
    return []


def _check_inputs(kwargs, chunked_labels):
    if kwargs.get("labels") is not None and not chunked_labels:
        raise ValueError("fsdpturbo Ulysses: labels were passed to a model whose sequences are split over its Ulysses "
                         "group, but distributed.cp_plan.loss_function_patches is empty, so the loss would not shift "
                         "across the chunks; accepted: a causal_lm_loss patch, or no labels (compute the loss "
                         "yourself)")
    if kwargs.get("position_ids") is None:
        raise ValueError("fsdpturbo Ulysses: no position_ids were passed to a model whose sequences are split over its "
                         "Ulysses group, so every chunk would count positions from 0; accepted: the position_ids of "
                         "this rank's chunk (the whole sequence's, chunked like input_ids)")
