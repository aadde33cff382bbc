"""`FSDPTurbo(config, model)`: the standalone API's wrapper, `fsdp_turbo.fsdp_turbo`.

It transforms `model` in place, in the original's order: the parallel state, Ulysses context
parallelism (`cp_plan`, `fsdpturbo.ulysses`; with ulysses_parallel_size > 1), the module
patches, expert parallelism and expert FSDP (`fsdpturbo.ep`, `fsdpturbo.efsdp`), activation
recomputation (of the `recompute_plan` modules Hugging Face's own checkpointing does not
already recompute; like it, they take no KV cache in training), then the outer FSDP2 (HSDP
over data × fully-shard). Parameter names and global shapes stay the Hugging Face model's, and nothing reads parameter values: the model may be on
the meta device on every rank but 0, and its weights are loaded afterwards with
`set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`, as verl and the
ms-swift fork do. The configuration is read when wrapping (consumers change fields, such as
`fsdp_plan.cpu_offload`, after construction).

A PEFT model (verl's LoRA path hands over `get_peft_model`'s) is transformed as `shard_model`
does it: the plan's module and parameter names are those of the model inside it
(`get_base_model()`: `model.layers.{*}.mlp.experts`), and a name written with PEFT's prefix
`base_model.model.` names the same module; with ep > 1 the adapters on the experts
(`target_parameters`) move onto the expert modules (`fsdpturbo.moe.expert_lora`), the PEFT
model's `save_pretrained` is guarded and its `load_state_dict` takes the experts in PEFT's names
and layout, as verl loads them (`fsdpturbo.adapters.guard_taken_over`).
`.model` stays the PEFT model, the root of the outer FSDP2.

Gradients: each rank's loss is the mean over its share of the global batch (under Ulysses,
the whole loss of its data rank's sequences, the same on every rank of its Ulysses group, as
`causal_lm_loss` gives it), so every gradient is the sum over the ranks holding it divided by
the world size (the dense HSDP's default, the
experts' `gradient_divide_factor`); parameters kept whole outside FSDP2 (`ignored_modules`,
`ignored_params`) are summed over all ranks and divided alike.
"""
import copy
import dataclasses
import logging

import torch
import torch.distributed as dist
from torch import nn

from fsdpturbo import adapters
from fsdpturbo.efsdp import expert_fully_shard_modules, mixed_precision_policy
from fsdpturbo.engine import reduce_replicated_gradients
from fsdpturbo.ep import expert_parallelize_modules
from fsdpturbo.moe import expert_lora
from fsdpturbo.patch import apply_module_patch
from fsdpturbo.pattern import Pattern
from fsdpturbo.ulysses import apply_cp_plan

from . import config_check
from .config_check import PATCH_KEYS, ConfigError
from .distributed.parallel_state import init_parallel_state

__all__ = ["FSDPTurbo"]

logger = logging.getLogger(__name__)


PEFT_PREFIX = "base_model.model."  # a PEFT model's names of the model inside it


def _inner_name(name):
    """A plan's module or parameter name, against the model inside a PEFT model."""
    return name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name


def _matching(model, patterns, path):
    """{pattern: [(name, module) of `model` matching it, in named_modules order]}; a pattern
    matching no module is a ConfigError naming `path`. A pattern's PEFT prefix is dropped
    (`_inner_name`: `model` is never a PEFT model)."""
    named = list(model.named_modules())
    found = {}
    for pattern in patterns:
        compiled = Pattern(_inner_name(pattern))
        found[pattern] = [(name, module) for name, module in named if compiled.match(name)]
    unmatched = [p for p, hits in found.items() if not hits]
    if unmatched:
        raise ConfigError([f"{path}: {p!r} matches no module of {type(model).__name__} (e.g. "
                           f"{', '.join(repr(n) for n, _ in named[1:4])})" for p in unmatched])
    return found


_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past")


def _without_cache(module, args, kwargs):
    """What Hugging Face's checkpointed layers do in training: no KV cache (the recomputation
    would append to it a second time)."""
    if not (module.training and torch.is_grad_enabled()):
        return None
    kwargs = {k: (None if k in _CACHE_ARGUMENTS else v) for k, v in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return args, kwargs


class FSDPTurbo(nn.Module):
    """`FSDPTurbo(config, model).model` is `model`, sharded; `.parallel_state` the process's
    `fsdp_turbo.distributed.parallel_state.ParallelState`. `model` may be a PEFT model (the
    plan names the model inside it; see the module's doc). Collective: every rank wraps the
    same model structure with the same configuration."""

    def __init__(self, config, model):
        super().__init__()
        self.config = config
        self.model = model
        self.parallel_state = init_parallel_state(config)
        config_check.topology(config, dist.get_world_size())  # again: fields change after construction
        self._apply_context_parallel()
        self._apply_module_patches()
        self._apply_expert_parallel()
        self._apply_recompute()
        self._apply_fully_shard()
        adapters.guard_taken_over(self.model, self._inner)

    @property
    def _inner(self):
        """The model the plan names: the model inside a PEFT model, else `.model` itself."""
        return expert_lora.inner_model(self.model)

    def _apply_context_parallel(self):
        distributed = self.config.distributed
        if distributed.ulysses_parallel_size == 1:
            return
        attention = getattr(getattr(self._inner, "config", None), "_attn_implementation", None)
        if any(e["type"] == "full_attention" for e in distributed.cp_plan.ulysses_function_patches) \
                and attention != "eager":
            raise ConfigError([f"distributed.cp_plan.ulysses_function_patches: full_attention wraps the eager "
                               f"attention function, but {type(self._inner).__name__} attends with {attention!r}, "
                               f"which does not call it; accepted: a model with attn_implementation='eager'"])
        problems = apply_cp_plan(self._inner, self.parallel_state.get_ulysses_group(), distributed.cp_plan)
        if problems:
            raise ConfigError(problems)

    def _apply_module_patches(self):
        unmatched = []
        for i, spec in enumerate(self.config.module_patches):
            target_key, replacement_key = next(k for k in PATCH_KEYS if set(spec) == set(k))
            if not apply_module_patch(self._inner, spec[target_key], spec[replacement_key]):
                unmatched.append(f"module_patches[{i}]: target {spec[target_key]!r} is neither a module-level "
                                 f"callable nor a 'module.Class.member' of a class of this model's modules")
        if unmatched:
            raise ConfigError(unmatched)

    def _apply_expert_parallel(self):
        distributed = self.config.distributed
        if distributed.expert_parallel_size == 1:
            return
        plan = distributed.ep_plan
        for field in ("apply_modules", "apply_efsdp_modules"):  # each pattern must match (the engine: any)
            _matching(self._inner, getattr(plan, field) or [], f"distributed.ep_plan.{field}")
        # EFSDP shards the expert modules inside each unit: without `.experts` parents, the
        # expert modules are the units.
        names = [_inner_name(p) for p in plan.apply_modules or []]
        plan = dataclasses.replace(plan, apply_modules=names,
                                   apply_efsdp_modules=[_inner_name(p) for p in plan.apply_efsdp_modules or []] or names)
        fsdp_plan = copy.copy(distributed.fsdp_plan)
        fsdp_plan.hook_modules = fsdp_plan.hook_modules and [_inner_name(p) for p in fsdp_plan.hook_modules]
        expert_parallelize_modules(self._inner, self.parallel_state.get_ep_device_mesh(), plan)
        expert_fully_shard_modules(self._inner, self.parallel_state.get_efsdp_device_mesh(), plan, fsdp_plan)

    def _apply_recompute(self):
        from torch.distributed._composable import checkpoint

        memory = self.config.memory
        if not memory.recompute:
            return
        matched = _matching(self._inner, memory.recompute_plan, "memory.recompute_plan")
        for name, module in {id(m): (n, m) for hits in matched.values() for n, m in hits}.values():
            if getattr(module, "gradient_checkpointing", False) is True:
                # Hugging Face's own checkpointing (verl's enable_gradient_checkpointing) already
                # recomputes it; a second checkpoint around the same forward would nest.
                logger.info("fsdp_turbo recompute: %s already recomputes under Hugging Face's checkpointing", name)
                continue
            module.register_forward_pre_hook(_without_cache, with_kwargs=True)
            checkpoint(module)  # hooks only: names stay the model's

    def _ignored_params(self, plan):
        """The parameters the outer FSDP2 leaves alone: those of `ignored_modules` and the named
        `ignored_params` (an unknown name is a ConfigError)."""
        matched = _matching(self._inner, plan.ignored_modules, "distributed.fsdp_plan.ignored_modules")
        ignored = {id(p): p for hits in matched.values() for _, m in hits for p in m.parameters()}
        params = dict(self._inner.named_parameters())
        unknown = [n for n in plan.ignored_params if _inner_name(n) not in params]
        if unknown:
            raise ConfigError([f"distributed.fsdp_plan.ignored_params: {unknown} are no parameters of "
                               f"{type(self._inner).__name__} (e.g. {list(params)[:3]})"])
        ignored.update({id(params[_inner_name(n)]): params[_inner_name(n)] for n in plan.ignored_params})
        return list(ignored.values())

    def _apply_fully_shard(self):
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
        from torch.distributed.tensor import DTensor

        plan = self.config.distributed.fsdp_plan
        matched = _matching(self._inner, list(plan.apply_modules or {}), "distributed.fsdp_plan.apply_modules")
        options = {}  # unit name -> its fully_shard options (the first pattern matching it)
        for pattern, hits in matched.items():
            for name, _ in hits:
                options.setdefault(name, plan.apply_modules[pattern])
        ignored = self._ignored_params(plan)
        ignored_ids = {id(p) for p in ignored}
        offload = CPUOffloadPolicy(pin_memory=plan.pin_memory) if plan.cpu_offload else OffloadPolicy()
        mesh = self.parallel_state.get_dp_fsdp_device_mesh()
        units = [(name, module) for name, module in self._inner.named_modules() if name in options and name]
        # children before their parents, the root last: each unit owns what no inner unit holds
        for name, module in sorted(units, key=lambda unit: -unit[0].count(".")) + [("", self.model)]:
            params = list(module.parameters())
            skipped = {p for p in params if id(p) in ignored_ids}
            kwargs = dict(mesh=mesh, reshard_after_forward=plan.reshard_after_forward,
                          mp_policy=mixed_precision_policy([p for p in params if id(p) not in ignored_ids], plan),
                          offload_policy=offload, ignored_params=skipped or None)
            kwargs.update(options.get(name, {}))
            fully_shard(module, **kwargs)
        self._set_prefetch([module for _, module in units], plan)
        reduce_replicated_gradients(self.model, [p for p in ignored if not isinstance(p, DTensor)],
                                    dist.get_world_size())

    @staticmethod
    def _set_prefetch(units, plan):
        """Each unit prefetches the next `num_to_forward_prefetch` units (in forward order) in
        forward, and the previous `num_to_backward_prefetch` in backward."""
        for i, unit in enumerate(units):
            if plan.num_to_forward_prefetch:
                following = units[i + 1:i + 1 + plan.num_to_forward_prefetch]
                if following:
                    unit.set_modules_to_forward_prefetch(following)
            if plan.num_to_backward_prefetch:
                preceding = units[max(0, i - plan.num_to_backward_prefetch):i][::-1]
                if preceding:
                    unit.set_modules_to_backward_prefetch(preceding)

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def close(self):
        """Nothing to release (the original closes its MoonEP runtime, which is not built)."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        self.close()
        return False
