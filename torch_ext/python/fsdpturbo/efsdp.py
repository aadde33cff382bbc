"""Expert FSDP (EFSDP): FSDP2 over the efsdp mesh for the expert-side modules, and the
gradient reduction rule every FSDP2 unit of the engine follows (docs/design.md §4.1).

The rule. Every rank's backward leaves in each parameter the contribution of the tokens it
saw (for experts: of every token its EP group routed to them, through the all-to-all's
backward). The gradient the optimizer sees is the SUM of those contributions over every rank
that holds a replica or a shard of the parameter, divided by one factor F:

* FSDP2 reduce-scatters over its own mesh (SUM), then an all-reduce hook SUMs over the
  replica groups: every other dim of the root mesh (for expert weights on the expert mesh
  (edp, efsdp, ep, expert_cp): edp and expert_cp, the ep dim shards them; for the outer FSDP2
  over dp, which also owns the router and shared expert: cp), and FSDP2 divides by F.
* With expert parallelism alone (efsdp = 1, LlamaFactory calls no EFSDP) the EP forward's
  backward does the same for the expert weights (`fsdpturbo.moe.dispatch.experts.expert_weight`).
* F defaults to the world size (the plan's `gradient_divide_factor`): each rank's loss is the
  mean over its own equal share of the global batch, so the mean over the global batch is the
  sum over ranks divided by W. With Ulysses context parallelism (LlamaFactory's, verl's) each
  cp rank's loss is its sequence's whole loss, whose backward reaches each cp rank's chunk once
  per cp rank: the sum over ranks is again W times the mean's. A trainer with another loss
  convention sets F (`EPPlanConfig.gradient_divide_factor`).

Only NCCL has `PREMUL_SUM`; elsewhere (gloo, HCCL) a factor other than the group size makes
FSDP2 reduce with SUM and divide afterwards (`set_force_sum_reduction_for_comms`), instead of
the seed's patch of torch.distributed. (Not on a group of size 1: there torch 2.15 would divide
twice.)
"""
import dataclasses
import functools
import logging
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch import nn

from .moe.ep_state import ep_modules, state
from .pattern import Pattern, match_modules

logger = logging.getLogger(__name__)

FSDP_IMPLEMENTATIONS = ("custom", "native")

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}


@dataclasses.dataclass
class FSDPPlanConfig:
    """The seed's `FSDPPlanConfig` (fields and defaults of fsdp_turbo_config.py). `param_dtype`
    None means the parameters' own dtype, `reduce_dtype` None float32."""
    ignored_modules: List[str] = dataclasses.field(default_factory=list)
    apply_modules: Dict[str, Any] = None
    param_dtype: str = None
    reduce_dtype: str = None
    output_dtype: str = None
    cast_forward_inputs: bool = True
    cpu_offload: bool = False
    pin_memory: bool = True
    num_to_forward_prefetch: int = 0
    num_to_backward_prefetch: int = 0
    hook_modules: List[str] = None
    fsdp_implementation: str = "native"
    gradient_divide_factor: float = None


def _dtype(value, field):
    if value is None or isinstance(value, torch.dtype):
        return value
    try:
        return _DTYPES[str(value).lower()]
    except KeyError:
        raise ValueError(f"FSDPPlanConfig.{field} is {value!r}; accepted: {sorted(_DTYPES)} or a torch.dtype") \
            from None


def _post_order(module, prefix=""):
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


def get_fsdp_hook_modules(model, plan):
    """The seed's hook-module search: [] when `plan.apply_modules` is None; else every module
    (children before parents, root "" last) matching a `hook_modules` pattern; patterns that
    match nothing raise `[FSDP2] No module named [...]`, also for the native implementation."""
    if plan.apply_modules is None or not plan.hook_modules:
        return []
    patterns = [Pattern(p) for p in plan.hook_modules]
    hooks = [m for name, m in _post_order(model) if any(p.match(name) for p in patterns)]
    if not hooks:
        raise RuntimeError(f"[FSDP2] No module named {plan.hook_modules}.")
    return hooks


def _check_implementation(impl):
    if impl not in FSDP_IMPLEMENTATIONS:
        raise ValueError(f"Unknown FSDP implementation: {impl}. Supported: {sorted(FSDP_IMPLEMENTATIONS)}")
    if impl == "custom":
        raise NotImplementedError("fsdp_implementation='custom' (FSDPTurbo's fine-grained fully_shard that "
                                  "unshards at hook modules) is not implemented by fsdpturbo; use 'native' "
                                  "(torch FSDP2, which ignores hook_modules as the seed's native strategy does)")


def _all_reduce_sum(tensor, groups):
    for group in groups:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


def configure_gradient_reduction(fsdp_module, mesh, factor, replica_groups=()):
    """Applies the gradient rule to one FSDP2 unit sharded over the 1-D `mesh`: SUM over `mesh`
    (reduce-scatter) and over each of `replica_groups` (an all-reduce hook), then divide by
    `factor`. Groups of size 1 are skipped."""
    factor = float(factor)
    fsdp_module.set_gradient_divide_factor(factor)
    size = mesh.size()
    premul_sum = mesh.device_type == "cuda" and "nccl" in str(dist.get_backend(mesh.get_group()))
    if size > 1 and factor != size and not premul_sum:
        fsdp_module.set_force_sum_reduction_for_comms(True)
    groups = tuple(g for g in replica_groups if dist.get_world_size(g) > 1)
    if groups:
        fsdp_module.set_all_reduce_hook(functools.partial(_all_reduce_sum, groups=groups))


def gradient_divide_factor(ep_plan):
    """F of an `EPPlanConfig`: its `gradient_divide_factor`, or the world size when unset."""
    factor = ep_plan.gradient_divide_factor
    return float(dist.get_world_size()) if factor is None else float(factor)


def warn_if_cp_counted_twice(mesh, factor):
    """Logs a warning when the expert gradients of `mesh` (an ep mesh) are summed over an
    `expert_cp` dim of size cp > 1 of its root mesh and divided by `factor` = world / cp: with a
    loss each CP rank holds whole (LlamaFactory's Ulysses loss: cp × its chunk's share) that is
    cp × the mean gradient. LlamaFactory's pinned fsdpturbo plugin passes exactly that at
    cp_size > 1 (docs/llamafactory-cp.md)."""
    root = mesh._get_root_mesh()
    names = root.mesh_dim_names or ()
    cp = root.size(names.index("expert_cp")) if "expert_cp" in names else 1
    if cp > 1 and factor * cp == dist.get_world_size():
        logger.warning("[Expert Parallel] expert gradients are summed over the %d expert_cp ranks and divided by "
                       "gradient_divide_factor %g = world size / cp: with a loss every CP rank holds whole "
                       "(LlamaFactory's Ulysses loss) they come out %d× the mean gradient; LlamaFactory's pinned "
                       "fsdpturbo plugin does this at cp_size > 1: launch it with `torchrun -m "
                       "fsdpturbo.llamafactory.launch` instead (docs/llamafactory-cp.md)", cp, factor, cp)


def replica_groups(mesh, exclude_dims=()):
    """The process groups of every dim of `mesh`'s root mesh other than `mesh`'s own dims and
    `exclude_dims` (names): the ranks holding replicas of what `mesh` shards."""
    root = mesh._get_root_mesh()
    if root is mesh or root.mesh_dim_names is None:
        return []
    own = set(mesh.mesh_dim_names or ()) | set(exclude_dims)
    return [root.get_group(name) for i, name in enumerate(root.mesh_dim_names)
            if name not in own and root.size(i) > 1]


def mixed_precision_policy(params, plan):
    """FSDP2 mixed precision for `params` under `plan`: compute in `plan.param_dtype`, else the
    parameters' own dtype (never a hard-coded bf16); reduce in `plan.reduce_dtype`, else float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    floating = [p.dtype for p in params if p.is_floating_point()]
    param_dtype = _dtype(plan.param_dtype, "param_dtype") or (floating[0] if floating else None)
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=_dtype(plan.reduce_dtype, "reduce_dtype")
                                or torch.float32, output_dtype=_dtype(plan.output_dtype, "output_dtype"),
                                cast_forward_inputs=plan.cast_forward_inputs)


def _shard_placement(param):
    from torch.distributed.tensor import Shard

    return Shard(1) if param.dim() > 1 else Shard(0)


def _offload_policy(plan):
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    return CPUOffloadPolicy(pin_memory=plan.pin_memory) if plan.cpu_offload else OffloadPolicy()


def _shard_unit(unit, efsdp_mesh, plan, factor):
    """One EFSDP unit: each expert module inside it becomes its own FSDP2 unit over efsdp (its
    replicas: the root dims other than efsdp and the experts' ep dims), taking the gradient
    reduction over from expert parallelism. What else `unit` holds (router, shared expert) is
    left to the outer FSDP2 over dp: every ep rank holds it whole, and on the dp mesh each of
    its gradients is counted once by any norm that reduces by mesh (LlamaFactory's included)."""
    from torch.distributed.fsdp import fully_shard

    for _, module in ep_modules(unit):
        params = list(module.parameters())
        fully_shard(module, mesh=efsdp_mesh, shard_placement_fn=_shard_placement,
                    mp_policy=mixed_precision_policy(params, plan), offload_policy=_offload_policy(plan))
        ep_dims = {name for p in params for name in (p.device_mesh.mesh_dim_names or ())}
        configure_gradient_reduction(module, efsdp_mesh, factor, replica_groups(efsdp_mesh, ep_dims))
        state(module).gradient_reduction = None


def expert_fully_shard_modules(model, efsdp_mesh, ep_plan, fsdp_plan):
    """FSDP2 over `efsdp_mesh` for every module matched by `ep_plan.apply_efsdp_modules` (each
    child of a matched ModuleList): `Shard(1)` for parameters of two or more dims, `Shard(0)`
    for 1-D; expert weights, already `Shard(0)` DTensors on the ep mesh, become
    (Shard(1), Shard(0)) on (efsdp, ep). Mixed precision from `fsdp_plan` (param dtype: the
    parameters' own unless set; reduce dtype float32 unless set). Gradients follow the module
    docstring's rule with F = `ep_plan.gradient_divide_factor` (None: the world size).
    `fsdp_plan.hook_modules` must match (the seed's error); `fsdp_implementation` must be
    'native' ('custom' is not implemented here). `efsdp_mesh` is a 1-D sub-mesh sharing its
    root with the ep mesh (LlamaFactory's `expert_mesh["efsdp"]`). Returns `model`."""
    _check_implementation(fsdp_plan.fsdp_implementation)
    get_fsdp_hook_modules(model, fsdp_plan)
    units = match_modules(model, ep_plan.apply_efsdp_modules or [], "[Expert Fully Shard]", ep_plan)
    factor = gradient_divide_factor(ep_plan)
    for name, unit in units:
        logger.debug("[Expert Fully Shard]: Apply efsdp to module <%s>", name)
        for child in (list(unit) if isinstance(unit, nn.ModuleList) else [unit]):
            _shard_unit(child, efsdp_mesh, fsdp_plan, factor)
    return model
