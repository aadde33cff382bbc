"""The training engine: expert parallelism × expert FSDP × the outer FSDP2 for a Hugging Face
MoE model, in the seed's order (seed-semantics §8): storage dtype, the plan (from the Rust
core), EP, EFSDP, the outer FSDP2 per decoder layer and at the root over dp (expert weights
ignored there), materialisation from meta, the Hugging Face weights through `copy_weights_`,
and the grad-norm warm-up. Gradients follow DESIGN §4.1 (see `fsdpturbo.efsdp`).
"""
import functools
import logging

import torch
import torch.distributed as dist

from . import balance, expert_bias, expert_lora
from .checkpoint import checkpoint_fingerprint as dcp_fingerprint, load_model_weights
from .config import TrainConfig
from .consistency import check_same_on_every_rank, collective_step, model_structure
from .efsdp import (FSDPPlanConfig, configure_gradient_reduction, expert_fully_shard_modules,
                    mixed_precision_policy, replica_groups)
from .dispatch import Capacity
from .ep import EPPlanConfig, expert_parallelize_modules
from .layers import decoder_layers
from .norm import warmup_grad_norm
from .plan import resolve_plan
from .spec import FSDPTurboEPModelSpec
from .topology import ParallelState, get_parallel_state, initialize_parallel_state
from .weights import checkpoint_fingerprint as weights_fingerprint, load_hf_weights

logger = logging.getLogger(__name__)

__all__ = ["decoder_layers", "fully_shard_outer", "materialize", "reduce_replicated_gradients", "shard_model"]

_DEVICE_OF_BACKEND = {"nccl": "cuda", "hccl": "npu"}


def _default_device(device_type):
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


def fully_shard_outer(model, dp_mesh, factor, *, ignored_params=(), reshard_after_forward=True,
                      offload_policy=None):
    """The outer FSDP2 over `dp_mesh`: each decoder layer, then the root; parameters in
    `ignored_params` (and those already in EFSDP units) stay out. Mixed precision: the
    parameters' dtype for compute, float32 for the reduction. Gradients: SUM over dp and over
    the other dims of dp's root mesh (cp), divided by `factor`; ignored parameters that are
    plain tensors (kept whole, in no FSDP2 unit) get `reduce_replicated_gradients`. Returns
    `model`."""
    from torch.distributed.fsdp import OffloadPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    ignored_params = list(ignored_params)
    ignored = {id(p) for p in ignored_params}
    replicas = replica_groups(dp_mesh)
    offload_policy = offload_policy or OffloadPolicy()
    for module in decoder_layers(model) + [model]:
        params = list(module.parameters())
        skipped = {p for p in params if id(p) in ignored}
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=mixed_precision_policy([p for p in params if p not in skipped], FSDPPlanConfig()),
                    offload_policy=offload_policy, ignored_params=skipped or None)
        configure_gradient_reduction(module, dp_mesh, factor, replicas)
    reduce_replicated_gradients([p for p in ignored_params if not isinstance(p, DTensor)], factor)
    return model


def _reduce_hook(grad, factor):
    grad = grad.clone()
    dist.all_reduce(grad, op=dist.ReduceOp.SUM)
    return grad.div_(factor)


def reduce_replicated_gradients(params, factor):
    """For parameters kept whole on every rank outside any FSDP2 unit (`fsdp_ignored_modules`):
    each backward's incoming gradient is summed over all ranks and divided by `factor` before
    it is accumulated (correct under gradient accumulation)."""
    for p in params:
        if p.requires_grad:
            p.register_hook(functools.partial(_reduce_hook, factor=float(factor)))


def materialize(model, device, weights=None, copy_fn=None, dcp_path=None):
    """Gives every meta parameter and buffer storage on `device` (`to_empty`, keeping the
    values of real buffers such as rotary frequencies), then loads `weights` (a safetensors
    file or Hugging Face directory) or the model weights of the training checkpoint at
    `dcp_path` (`fsdpturbo.save_checkpoint`'s or LlamaFactory's, saved at any layout) if given.
    A meta model without either, or a meta buffer the checkpoint does not hold, is an error."""
    meta_params = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    meta_buffers = {n for n, b in model.named_buffers() if b.device.type == "meta"}
    if meta_params and weights is None and dcp_path is None:
        raise ValueError(f"fsdpturbo: {len(meta_params)} parameters (e.g. {meta_params[0]}) are on the meta device "
                         f"and no weights were given; pass weights=<checkpoint> or build the model on a real device")
    if meta_params or meta_buffers:
        saved = {n: b.detach().clone() for n, b in model.named_buffers() if n not in meta_buffers}
        model.to_empty(device=device)
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name in saved:
                    buffer.copy_(saved[name])
    loaded = set()
    if weights is not None:
        loaded = set(load_hf_weights(model, weights, **({"copy_fn": copy_fn} if copy_fn else {})))
    elif dcp_path is not None:
        loaded = set(load_model_weights(model, dcp_path))
    unset = sorted(meta_buffers - loaded)
    if unset:
        raise ValueError(f"fsdpturbo: the buffers {unset} were on the meta device and the checkpoint does not hold "
                         f"them; build the model under fsdpturbo.weights.meta_parameters() (parameters on meta, "
                         f"buffers real)")
    return model


def _state_for(config, device_type):
    state = get_parallel_state()
    if state is None:
        state = ParallelState.from_config(config, dist.get_world_size()).init_device_meshes(device_type)
        state = initialize_parallel_state(state)
    return state


def _read_inputs(train_config, weights):
    """The parsed training configuration (once: the state and the plan read this object) and
    the fingerprints of the checkpoints it and `weights` name, in one collective step: a rank
    whose configuration does not parse or whose checkpoint cannot be read makes every rank raise
    a ValueError naming it."""
    parsed = {}

    def read():
        config = parsed["config"] = TrainConfig.of(train_config)
        dcp_path = (config.values.get("dist") or {}).get("dcp_path")
        sources = {}
        if weights is not None:
            sources["weights checkpoint"] = weights_fingerprint(weights)
        if dcp_path:
            sources["dist_config.dcp_path checkpoint"] = dcp_fingerprint(dcp_path)
        return sources

    sources = collective_step("shard_model: reading the training configuration and checkpoints", read, ValueError)
    return parsed["config"], sources[dist.get_rank() if dist.is_initialized() else 0]


def shard_model(model, train_config, *, weights=None, state=None, device=None):
    """Shards a Hugging Face MoE model for training under `train_config` (a training YAML path,
    YAML text or dict, as `parse_train_config` takes, or a `TrainConfig`; parsed once) and
    returns it (same object, parameters replaced: build the optimizer afterwards):

    1. parameters cast to bf16 when `bf16: true`, else float32 (the storage dtype), and the
       model type's prepare function (`FSDPTurboEPModelSpec`) when it has one;
    2. the plan from the Rust core (expert modules, EFSDP units, ignored parameters, the
       gradient divide factor F = world size);
    3. with ep > 1: expert parallelism over the ep mesh, then EFSDP over the efsdp mesh (the
       plan's units; with efsdp = 1 the expert modules alone, so their gradients are reduced);
    4. the outer FSDP2 over dp per decoder layer and at the root (experts ignored there);
    5. materialisation of meta tensors on `device`, and the initial weights: `weights` (a Hugging
       Face safetensors checkpoint) loaded through `copy_weights_`, or `dist_config.dcp_path` (a
       training checkpoint of `fsdpturbo.save_checkpoint` or LlamaFactory, saved at any layout);
    6. the grad-norm warm-up.

    Load balancing (`fsdpturbo.balance`, `fsdpturbo.expert_bias`): a Qwen3-MoE / Qwen3.5-MoE
    model computes its aux loss as `dist_config.aux_loss_scope` says (default: over the global
    batch) and adds the router z-loss when `router_z_loss_coef` > 0; with
    `expert_bias_update_rate` (ep > 1) every EP router gets an expert bias for top-k selection,
    moved by `fsdpturbo.update_expert_bias(model)` once per optimizer step.

    `state`: a `ParallelState` with torch meshes (default: the process-global one, else one
    made from `train_config` for the current world and made global). `device`: where meta
    tensors are materialised (default: the mesh device, the current one for cuda/npu).

    A PEFT model is sharded through the model inside it and returned as itself; with ep > 1 its
    LoRA adapters on the experts (`target_parameters`) move onto the expert modules first
    (`fsdpturbo.expert_lora`).

    Collective: every rank calls it with the same arguments."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    given, model = model, expert_lora.inner_model(model)
    config, sources = _read_inputs(train_config, weights)
    cfg = config.values
    check_same_on_every_rank({"training configuration": cfg, "model structure": model_structure(model), **sources},
                             "shard_model")
    dist_cfg = cfg.get("dist") or {}
    dcp_path = dist_cfg.get("dcp_path")
    if dcp_path and weights is not None:
        raise ValueError(f"fsdpturbo: both dist_config.dcp_path ({dcp_path!r}) and weights=({weights!r}) give the "
                         f"initial weights; pass one")
    dtype = torch.bfloat16 if cfg["bf16"] else torch.float32
    logger.info("Using %s for FSDPTurbo full tuning.", dtype)
    model.to(dtype)
    spec = FSDPTurboEPModelSpec.get(model)
    model = spec.prepare(model) if spec is not None else model
    device_type = torch.device(device).type if device is not None else \
        _DEVICE_OF_BACKEND.get(dist.get_backend(), "cpu")
    state = state or _state_for(config, device_type)
    device = torch.device(device) if device is not None else _default_device(device_type)
    if state.ep_size > 1:
        expert_lora.take_over(model)  # the plan sees the expert modules themselves
    plan = resolve_plan(model, config, state)
    for warning in plan["warnings"]:
        logger.warning("fsdpturbo plan: %s", warning)
    factor = plan["gradient_divide_factor"]

    if state.ep_size > 1:
        expert_names = [m["name"] for m in plan["ep_modules"]]
        efsdp = state.efsdp_size > 1
        ep_plan = EPPlanConfig(apply_modules=expert_names, dispatcher=dist_cfg.get("ep_dispatcher", "eager"),
                               apply_efsdp_modules=plan["efsdp_modules"] if efsdp else expert_names,
                               gradient_divide_factor=factor, capacity=Capacity.from_dist_config(dist_cfg))
        fsdp_plan = FSDPPlanConfig(apply_modules={}, hook_modules=dist_cfg.get("hook_modules", []) if efsdp else [],
                                   fsdp_implementation=dist_cfg.get("fsdp_implementation", "native"))
        expert_parallelize_modules(model, state.sub_mesh("ep"), ep_plan)
        expert_fully_shard_modules(model, state.sub_mesh("efsdp"), ep_plan, fsdp_plan)
    if dist_cfg.get("expert_bias_update_rate") is not None:
        expert_bias.install(model, dist_cfg["expert_bias_update_rate"])
    balance.install(model, scope=dist_cfg.get("aux_loss_scope", "global"),
                    z_coef=dist_cfg.get("router_z_loss_coef", 0.0), factor=factor, device=device, cp_size=state.cp_size)
    params = dict(model.named_parameters())  # after EP, which replaced the expert parameters
    fully_shard_outer(model, state.sub_mesh("dp"), factor,
                      ignored_params=[params[n] for n in plan["ignored_params"]],
                      reshard_after_forward=dist_cfg.get("reshard_after_forward", True),
                      offload_policy=CPUOffloadPolicy(pin_memory=dist_cfg.get("pin_memory", True))
                      if dist_cfg.get("offload_params") else None)
    materialize(model, device, weights, dcp_path=dcp_path)
    warmup_grad_norm(model)
    return given
