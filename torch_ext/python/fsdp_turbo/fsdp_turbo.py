"""`FSDPTurbo(config, model)`: the standalone API's wrapper, `fsdp_turbo.fsdp_turbo`.

It transforms `model` in place, in the original's order: the parallel state, the module
patches, expert parallelism and expert FSDP (`fsdpturbo.ep`, `fsdpturbo.efsdp`), activation
recomputation (of the `recompute_plan` modules Hugging Face's own checkpointing does not
already recompute; like it, they take no KV cache in training), then the outer FSDP2 (HSDP
over data × fully-shard). Parameter names and global shapes stay the Hugging Face model's, and nothing reads parameter values: the model may be on
the meta device on every rank but 0, and its weights are loaded afterwards with
`set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`, as verl and the
ms-swift fork do. The configuration is read when wrapping (consumers change fields, such as
`fsdp_plan.cpu_offload`, after construction).

Gradients: each rank's loss is the mean over its share of the global batch, so every gradient
is the sum over the ranks holding it divided by the world size (the dense HSDP's default, the
experts' `gradient_divide_factor`); parameters kept whole outside FSDP2 (`ignored_modules`,
`ignored_params`) are summed over all ranks and divided alike.
"""
import dataclasses
import logging

import torch
import torch.distributed as dist
from torch import nn

from fsdpturbo.efsdp import expert_fully_shard_modules, mixed_precision_policy
from fsdpturbo.engine import reduce_replicated_gradients
from fsdpturbo.ep import expert_parallelize_modules
from fsdpturbo.patch import apply_module_patch
from fsdpturbo.pattern import Pattern

from . import config_check
from .config_check import PATCH_KEYS, ConfigError
from .distributed.parallel_state import init_parallel_state

__all__ = ["FSDPTurbo"]

logger = logging.getLogger(__name__)


def _matching(model, patterns, path):
    """{pattern: [(name, module) matching it, in named_modules order]}; a pattern matching no
    module is a ConfigError naming `path`."""
    named = list(model.named_modules())
    found = {}
    for pattern in patterns:
        compiled = Pattern(pattern)
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
    `fsdp_turbo.distributed.parallel_state.ParallelState`. Collective: every rank wraps the same
    model structure with the same configuration."""

    def __init__(self, config, model):
        super().__init__()
        self.config = config
        self.model = model
        self.parallel_state = init_parallel_state(config)
        config_check.topology(config, dist.get_world_size())  # again: fields change after construction
        self._apply_module_patches()
        self._apply_expert_parallel()
        self._apply_recompute()
        self._apply_fully_shard()

    def _apply_module_patches(self):
        unmatched = []
        for i, spec in enumerate(self.config.module_patches):
            target_key, replacement_key = next(k for k in PATCH_KEYS if set(spec) == set(k))
            if not apply_module_patch(self.model, spec[target_key], spec[replacement_key]):
                unmatched.append(f"module_patches[{i}]: target {spec[target_key]!r} is neither a module-level "
                                 f"callable nor a 'module.Class.member' of a class of this model's modules")
        if unmatched:
            raise ConfigError(unmatched)

    def _apply_expert_parallel(self):
        distributed = self.config.distributed
        if distributed.expert_parallel_size == 1:
            return
        plan = distributed.ep_plan
        # EFSDP shards the expert modules inside each unit: without `.experts` parents, the
        # expert modules are the units.
        plan = dataclasses.replace(plan, apply_efsdp_modules=plan.apply_efsdp_modules or plan.apply_modules)
        for field in ("apply_modules", "apply_efsdp_modules"):  # each pattern must match (the engine: any)
            _matching(self.model, getattr(plan, field), f"distributed.ep_plan.{field}")
        expert_parallelize_modules(self.model, self.parallel_state.get_ep_device_mesh(), plan)
        expert_fully_shard_modules(self.model, self.parallel_state.get_efsdp_device_mesh(), plan,
                                   distributed.fsdp_plan)

    def _apply_recompute(self):
        from torch.distributed._composable import checkpoint

        memory = self.config.memory
        if not memory.recompute:
            return
        matched = _matching(self.model, memory.recompute_plan, "memory.recompute_plan")
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
        matched = _matching(self.model, plan.ignored_modules, "distributed.fsdp_plan.ignored_modules")
        ignored = {id(p): p for hits in matched.values() for _, m in hits for p in m.parameters()}
        params = dict(self.model.named_parameters())
        unknown = [n for n in plan.ignored_params if n not in params]
        if unknown:
            raise ConfigError([f"distributed.fsdp_plan.ignored_params: {unknown} are no parameters of "
                               f"{type(self.model).__name__} (e.g. {list(params)[:3]})"])
        ignored.update({id(params[n]): params[n] for n in plan.ignored_params})
        return list(ignored.values())

    def _apply_fully_shard(self):
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
        from torch.distributed.tensor import DTensor

        plan = self.config.distributed.fsdp_plan
        matched = _matching(self.model, list(plan.apply_modules or {}), "distributed.fsdp_plan.apply_modules")
        options = {}  # unit name -> its fully_shard options (the first pattern matching it)
        for pattern, hits in matched.items():
            for name, _ in hits:
                options.setdefault(name, plan.apply_modules[pattern])
        ignored = self._ignored_params(plan)
        ignored_ids = {id(p) for p in ignored}
        offload = CPUOffloadPolicy(pin_memory=plan.pin_memory) if plan.cpu_offload else OffloadPolicy()
        mesh = self.parallel_state.get_dp_fsdp_device_mesh()
        units = [(name, module) for name, module in self.model.named_modules() if name in options and name]
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
