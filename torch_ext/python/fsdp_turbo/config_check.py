"""The checks of an `FSDPTurboConfig`, all problems at once: each names its field's path and
what is accepted. What the Rust config core knows (the Ulysses size as its cp_size, expert
sizes, dispatcher, FSDP implementation, hook and ignored modules, the offload and reshard
flags) it checks, through a training configuration made of those fields, and its messages are
the ones reported; the topology on a world size is the Rust topology's; the rest (fields the
core has not, and what is not built) is checked here."""
import json
import re

from fsdpturbo.config import parse_train_config
from fsdpturbo.efsdp import mixed_precision_policy
from fsdpturbo.topology import ParallelState
from fsdpturbo.ulysses import entry_problems

__all__ = ["ConfigError", "check", "topology"]


class ConfigError(ValueError):
    """Every problem of a configuration, one per line."""

    def __init__(self, problems):
        self.problems = list(problems)
        count = f"{len(self.problems)} problem{'s' if len(self.problems) > 1 else ''}"
        super().__init__(f"FSDPTurboConfig has {count}:" + "".join(f"\n  {p}" for p in self.problems))


# Top-level field of the Rust config core -> (FSDPTurboConfig path, value). Top-level fields are
# typed strictly, and None is sent as null (it is no size).
_RUST_TOP_FIELDS = {
    "cp_size": ("distributed.ulysses_parallel_size", lambda d: d.ulysses_parallel_size),
}
# dist_config key of the Rust config core -> (FSDPTurboConfig path, value, what the field holds
# where that is not a string). None is left out (the field's default). dist_config reads strings
# as LlamaFactory's command line gives them ('true' a boolean, '8' an integer), a Python field
# does not: a string there is refused here, not sent.
_RUST_DIST_FIELDS = {
    "ep_size": ("distributed.expert_parallel_size", lambda d: d.expert_parallel_size, "a positive integer"),
    "efsdp_size": ("distributed.expert_fully_shard_parallel_size", lambda d: d.expert_fully_shard_parallel_size,
                   "a positive integer or None"),
    "ep_dispatcher": ("distributed.ep_plan.dispatcher", lambda d: d.ep_plan.dispatcher, None),
    "fsdp_ignored_modules": ("distributed.fsdp_plan.ignored_modules", lambda d: d.fsdp_plan.ignored_modules, None),
    "hook_modules": ("distributed.fsdp_plan.hook_modules", lambda d: d.fsdp_plan.hook_modules, None),
    "fsdp_implementation": ("distributed.fsdp_plan.fsdp_implementation", lambda d: d.fsdp_plan.fsdp_implementation,
                            None),
    "offload_params": ("distributed.fsdp_plan.cpu_offload", lambda d: d.fsdp_plan.cpu_offload, "a boolean"),
    "pin_memory": ("distributed.fsdp_plan.pin_memory", lambda d: d.fsdp_plan.pin_memory, "a boolean"),
    "reshard_after_forward": ("distributed.fsdp_plan.reshard_after_forward",
                              lambda d: d.fsdp_plan.reshard_after_forward, "a boolean"),
}
_RUST_PATHS = {**{key: path for key, (path, _) in _RUST_TOP_FIELDS.items()},
               **{f"dist_config.{key}": path for key, (path, _, _) in _RUST_DIST_FIELDS.items()}}
_RUST_LINE = re.compile(r"^((?:dist_config\.)?\w+)(\S*) \(line \d+\): (.*)$")


def _rust_problems(distributed):
    config = {key: value_of(distributed) for key, (_, value_of) in _RUST_TOP_FIELDS.items()}
    dist_config, problems = {"name": "fsdpturbo"}, []
    for key, (path, value_of, holds) in _RUST_DIST_FIELDS.items():
        value = value_of(distributed)
        if value is None or callable(value):  # a callable dispatcher is the user's own
            continue
        if holds is not None and isinstance(value, str):
            problems.append(f"{path}: expected {holds}, got {value!r} (a string is not converted)")
        else:
            dist_config[key] = value
    try:
        parse_train_config(json.dumps({**config, "dist_config": dist_config}, default=repr))
    except ValueError as error:
        for line in str(error).splitlines():
            match = _RUST_LINE.match(line)
            known = match is not None and match[1] in _RUST_PATHS
            problems.append(f"{_RUST_PATHS[match[1]]}{match[2]}: {match[3]}" if known else line)
    return problems


def _is_size(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_strings(value):
    return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)


def _size_problems(d):
    # ulysses_parallel_size is the Rust core's cp_size (_rust_problems). fully_shard_parallel_size
    # is its mp_shard_size, but given alone the core would check it against cp_size as if it were
    # the world size; data_parallel_size (its mp_replicate_size) may be None, which the core's is not.
    problems = [f"distributed.{name}: expected a positive integer, got {getattr(d, name)!r}"
                for name in ("fully_shard_parallel_size", "tensor_parallel_size") if not _is_size(getattr(d, name))]
    problems += [f"distributed.{name}: expected a positive integer or None (derived from the world size), got "
                 f"{getattr(d, name)!r}" for name in ("data_parallel_size", "expert_data_parallel_size")
                 if getattr(d, name) is not None and not _is_size(getattr(d, name))]
    return problems


def _not_built(config):
    """Fields whose feature fsdpturbo does not build: set, they are an error, not a no-op."""
    d, problems = config.distributed, []
    if _is_size(d.tensor_parallel_size) and d.tensor_parallel_size > 1:
        problems.append(f"distributed.tensor_parallel_size: {d.tensor_parallel_size}, but tensor parallelism is not "
                        f"built in fsdpturbo; accepted: 1 (tp_plan is then not used)")
    if d.fsdp_plan.fsdp_implementation == "custom":
        problems.append("distributed.fsdp_plan.fsdp_implementation: 'custom' (FSDPTurbo's fine-grained fully_shard) "
                        "is not built; accepted: 'native' (torch FSDP2)")
    if d.fsdp_plan.param_init_fn is not None:
        problems.append("distributed.fsdp_plan.param_init_fn: not built (load the weights after wrapping, with "
                        "set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)); accepted: None")
    if d.ep_plan.moonep_config is not None:
        problems.append("distributed.ep_plan.moonep_config: MoonEP is not built; accepted: None")
    if config.memory.chunk_batch:
        problems.append("memory.chunk_batch: chunked batches are not built; accepted: False")
    plan = config.quantization.quantization_plan
    if plan and any(v not in (None, False, "", [], {}) for v in (plan.values() if isinstance(plan, dict) else [plan])):
        problems.append(f"quantization.quantization_plan: {plan!r}, but quantisation is not built; accepted: None")
    return problems


_FULLY_SHARD_OPTIONS = ("reshard_after_forward", "shard_placement_fn", "mp_policy", "offload_policy")


def _fsdp_plan_problems(plan):
    path, problems = "distributed.fsdp_plan", []
    for name in ("param_dtype", "reduce_dtype", "output_dtype"):
        probe = type(plan)(**{name: getattr(plan, name)})
        try:
            mixed_precision_policy([], probe)
        except ValueError as error:
            problems.append(f"{path}.{name}: {error}")
    for name in ("num_to_forward_prefetch", "num_to_backward_prefetch"):
        value = getattr(plan, name)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            problems.append(f"{path}.{name}: expected an integer >= 0, got {value!r}")
    if not isinstance(plan.cast_forward_inputs, bool):  # reshard_after_forward: the Rust core's (_rust_problems)
        problems.append(f"{path}.cast_forward_inputs: expected a boolean, got {plan.cast_forward_inputs!r}")
    if plan.apply_modules is not None:
        if not isinstance(plan.apply_modules, dict):
            problems.append(f"{path}.apply_modules: expected a mapping of module pattern -> fully_shard options, got "
                            f"{plan.apply_modules!r}")
        else:
            for pattern, options in plan.apply_modules.items():
                unknown = sorted(set(options) - set(_FULLY_SHARD_OPTIONS)) if isinstance(options, dict) else None
                if not isinstance(pattern, str) or unknown is None or unknown:
                    problems.append(f"{path}.apply_modules[{pattern!r}]: expected a pattern -> a mapping of fully_shard "
                                    f"options, got {options!r}; accepted options: {', '.join(_FULLY_SHARD_OPTIONS)}")
    if not _is_strings(plan.ignored_params):
        problems.append(f"{path}.ignored_params: expected a list of parameter names, got {plan.ignored_params!r}")
    return problems


def _pattern_list_problems(config):
    d, m = config.distributed, config.memory
    lists = {"distributed.ep_plan.apply_modules": d.ep_plan.apply_modules,
             "distributed.ep_plan.apply_efsdp_modules": d.ep_plan.apply_efsdp_modules,
             "distributed.tp_plan.colwise_parallel": d.tp_plan.colwise_parallel,
             "distributed.tp_plan.rowwise_parallel": d.tp_plan.rowwise_parallel,
             "distributed.tp_plan.sequence_parallel": d.tp_plan.sequence_parallel,
             "memory.recompute_plan": m.recompute_plan}
    problems = [f"{path}: expected a list of module patterns, got {value!r}"
                for path, value in lists.items() if value is not None and not _is_strings(value)]
    if _is_size(d.expert_parallel_size) and d.expert_parallel_size > 1 and not d.ep_plan.apply_modules:
        problems.append(f"distributed.ep_plan.apply_modules: empty, but expert_parallel_size is "
                        f"{d.expert_parallel_size}; accepted: the expert module patterns, e.g. "
                        f"['model.layers.{{*}}.mlp.experts']")
    if not isinstance(m.recompute, bool):
        problems.append(f"memory.recompute: expected a boolean, got {m.recompute!r}")
    elif m.recompute and not m.recompute_plan:
        problems.append("memory.recompute_plan: empty while memory.recompute is True, so nothing would be "
                        "recomputed; accepted: module patterns, e.g. ['model.layers.{*}']")
    return problems


PATCH_KEYS = (("target", "replacement"), ("target_function", "patch_function"))
NOT_BUILT_MODELS = "fsdp_turbo.models."


def _module_patch_problems(patches):
    if not isinstance(patches, (list, tuple)):
        return [f"module_patches: expected a list of {{'target': ..., 'replacement': ...}}, got {patches!r}"]
    problems = []
    for i, spec in enumerate(patches):
        keys = next((k for k in PATCH_KEYS if isinstance(spec, dict) and set(spec) == set(k)), None)
        if keys is None or not isinstance(spec[keys[0]], str) or not (isinstance(spec[keys[1]], str)
                                                                        or callable(spec[keys[1]])):
            problems.append(f"module_patches[{i}]: expected {{'target': dotted path, 'replacement': callable or dotted "
                            f"path}} (or the older target_function / patch_function keys), got {spec!r}")
        elif isinstance(spec[keys[1]], str) and spec[keys[1]].startswith(NOT_BUILT_MODELS):
            problems.append(f"module_patches[{i}].{keys[1]}: {spec[keys[1]]!r}: FSDPTurbo's model forwards "
                            f"({NOT_BUILT_MODELS}*, e.g. the Qwen3.5 forwards that split the sequence for CP after the "
                            f"embedding fusion) are not built in fsdpturbo; accepted: a callable or dotted path of your "
                            f"own")
    return problems


def check(config):
    """Raises ConfigError listing every problem of `config` that needs no world size."""
    d = config.distributed
    problems = _size_problems(d) + _rust_problems(d) + _not_built(config) + _fsdp_plan_problems(d.fsdp_plan) \
        + _pattern_list_problems(config) + _module_patch_problems(config.module_patches) + entry_problems(d.cp_plan)
    if problems:
        raise ConfigError(problems)


def _divisors(n):
    return ", ".join(str(k) for k in range(1, n + 1) if n % k == 0)


def topology(config, world_size):
    """`config` checked again (its fields may have changed since construction) and its
    topology on `world_size` ranks from the Rust core (a `fsdpturbo.topology.ParallelState`:
    the model mesh (mp_replicate, mp_shard) is the dense HSDP (data, fully-shard), the data mesh
    (dp, cp) the ranks that take different samples and the Ulysses groups (consecutive ranks),
    the expert mesh (edp, efsdp, ep, expert_cp)); sizes that do not fit raise ConfigError."""
    check(config)
    d = config.distributed
    fsdp = d.fully_shard_parallel_size
    if world_size % fsdp:
        raise ConfigError([f"distributed.fully_shard_parallel_size: {fsdp} does not divide the world size "
                           f"{world_size}; accepted: {_divisors(world_size)}"])
    ulysses = d.ulysses_parallel_size
    if world_size % ulysses:
        raise ConfigError([f"distributed.ulysses_parallel_size: {ulysses} does not divide the world size "
                           f"{world_size}; accepted: {_divisors(world_size)}"])
    try:
        state = ParallelState(world_size, cp_size=ulysses, mp_replicate_size=world_size // fsdp, mp_shard_size=fsdp,
                              ep_size=d.expert_parallel_size, efsdp_size=d.expert_fully_shard_parallel_size)
    except ValueError as error:
        cp = f" with ulysses_parallel_size ({ulysses}, cp_size; dp_size = world / it)" if ulysses > 1 else ""
        raise ConfigError([f"distributed.expert_parallel_size ({d.expert_parallel_size}, ep_size) and "
                           f"expert_fully_shard_parallel_size ({d.expert_fully_shard_parallel_size}, efsdp_size)"
                           f"{cp} on {world_size} ranks: {error}"]) from None
    derived = {"data_parallel_size": world_size // fsdp, "expert_data_parallel_size": state.edp_size}
    problems = [f"distributed.{name}: {getattr(d, name)}, but on {world_size} ranks it is {value}; accepted: "
                f"{value} or None" for name, value in derived.items() if getattr(d, name) not in (None, value)]
    if problems:
        raise ConfigError(problems)
    return state

