"""Expert parallelism: `expert_parallelize_modules(model, ep_mesh, plan)`, the module surgery
(expert weights sharded over the ep mesh, their gradient reduction, the dispatcher's forward
installed); the token dispatchers themselves are fsdpturbo.moe.dispatch.
"""
import dataclasses
from typing import Callable, List, Optional, Union

import torch
from torch.distributed.tensor import DTensor, Shard

from .consistency import check_same_on_every_rank, model_structure
from .efsdp import gradient_divide_factor, replica_groups, warn_if_cp_counted_twice
from .layers import decoder_layers
from .moe import dispatch, ep_state, expert_lora, router_replay
from .moe.dispatch import get_dispatcher_fn  # also imported from here by fsdp_turbo (the seed's path)
from .moe.dispatch.experts import GradientReduction
from .pattern import match_modules


@dataclasses.dataclass
class EPPlanConfig:
    """The seed's `EPPlanConfig` (fields and defaults of fsdp_turbo_config.py)."""
    apply_modules: List[str] = None
    dispatcher: Union[str, Callable] = None
    fixed_router: bool = False
    apply_efsdp_modules: List[str] = None
    moonep_config: Optional[object] = None
    gradient_divide_factor: Optional[float] = None
    capacity: Optional[dispatch.Capacity] = None  # ours: the capacity-bounded dispatch (None: dropless)


def distribute_expert_weights(module, ep_mesh):
    """Every direct parameter of `module` becomes its `Shard(0)` slice on `ep_mesh`, as a new
    nn.Parameter holding a DTensor (the seed's `distribute_expert_weight`)."""
    ep_size, ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for name, param in list(module.named_parameters(recurse=False)):
        rows = param.size(0)
        if rows % ep_size:
            raise AssertionError(f"Number of experts({rows}) is not divisible by ep size({ep_size}).")
        local_rows = rows // ep_size
        local = param.detach()[ep_rank * local_rows:(ep_rank + 1) * local_rows].clone()
        dtensor = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
        setattr(module, name, torch.nn.Parameter(dtensor, requires_grad=param.requires_grad))


def expert_parallelize_modules(model, ep_mesh, plan):
    """Applies expert parallelism to every module matched by `plan.apply_modules` (seed §4.1):
    expert weights become `Shard(0)` DTensors on `ep_mesh`, the module gets its state
    (`fsdpturbo.moe.ep_state`) with the seed's `num_global_experts`, `num_local_experts`,
    `local_expert_indices` and `expert_ids_per_ep_rank` as read-only views, and its forward is
    replaced by the dispatcher's (`fsdpturbo.moe.dispatch.install`). Returns `model`.

    Gradients are right with expert parallelism alone (the seed leaves them unreduced, so with
    efsdp = 1 they are dp× too large): each backward sums an expert weight's gradient over the
    other dims of `ep_mesh`'s root mesh (edp, expert_cp; efsdp too if it is > 1 and EFSDP is
    never applied) and divides it by `plan.gradient_divide_factor` (None: the world size).
    `expert_fully_shard_modules`, when it follows, takes that over (no double reduction).

    The routers beside the expert modules (Qwen3 / Qwen3.5 MoE) record their routes for
    activation checkpointing and `fsdpturbo.moe.router_replay` (the recomputation takes the first
    forward's routes).

    PEFT's wrappers of expert weights (LoRA with `target_parameters`) are taken over first
    (`fsdpturbo.moe.expert_lora.take_over`): each expert's adapter is sharded with the expert, and
    the dispatcher applies it on the routed rows."""
    dispatch.check_implemented(plan.dispatcher)
    dispatcher = getattr(plan.dispatcher, "__qualname__", plan.dispatcher)
    check_same_on_every_rank({"ep size": ep_mesh.size(), "model structure": model_structure(model),
                              "EP plan": (plan.apply_modules, dispatcher, plan.fixed_router, plan.apply_efsdp_modules,
                                          plan.gradient_divide_factor, plan.capacity)}, "expert_parallelize_modules")
    expert_lora.take_over(model)
    matched = match_modules(model, plan.apply_modules or [], "[Expert Parallel]", plan)
    for name, module in matched:
        if expert_lora.expert_lora(module) is not None:
            dispatch.check_lora(plan.dispatcher, name)
    ep_group = ep_mesh.get_group()
    ep_size, ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
    forward = get_dispatcher_fn(plan.dispatcher, ep_group, fixed_router=plan.fixed_router, capacity=plan.capacity)
    reduction = GradientReduction(tuple(replica_groups(ep_mesh)), gradient_divide_factor(plan))
    warn_if_cp_counted_twice(ep_mesh, reduction.factor)
    names = []
    for name, module in matched:
        names.append(name)
        num_experts = module.num_experts if hasattr(module, "num_experts") else len(module)
        if num_experts % ep_size:
            raise AssertionError(f"Number of experts({num_experts}) is not divisible by ep size({ep_size}).")
        ep_state.attach(module, ep_state.EPModuleState(
            name=name, num_global_experts=num_experts, num_local_experts=num_experts // ep_size, ep_rank=ep_rank,
            dispatcher=forward, gradient_reduction=reduction, lora=expert_lora.expert_lora(module)))
        distribute_expert_weights(module, ep_mesh)
        dispatch.install(module)
    router_replay.install(model, names, decoder_layers(model))
    return model
