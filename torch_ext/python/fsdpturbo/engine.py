"""The training engine: expert parallelism × expert FSDP × the outer FSDP2 for a Hugging Face
MoE model, in the seed's order (docs/training.md): storage dtype, the plan (from the Rust
core), EP, EFSDP, the outer FSDP2 per decoder layer and at the root over dp (expert weights
ignored there), materialisation from meta, the Hugging Face weights through `copy_weights_`,
and the grad-norm warm-up. Gradients follow docs/design.md §4.1 (see `fsdpturbo.efsdp`).
The expert-sharding step (spec, plan, EP, EFSDP, ignored parameters) is shared with the
LlamaFactory engine (`fsdpturbo.llamafactory`).
"""
import functools
import logging

import torch
import torch.distributed as dist

from . import adapters
from .checkpoint import checkpoint_fingerprint as dcp_fingerprint, load_model_weights
from .config import TrainConfig
from ._dist import rank
from .consistency import check_same_on_every_rank, collective_step, model_structure
from .efsdp import (FSDPPlanConfig, configure_gradient_reduction, expert_fully_shard_modules,
                    mixed_precision_policy, replica_groups)
from .ep import EPPlanConfig, expert_parallelize_modules
from .layers import decoder_layers
from .moe import balance, expert_bias, expert_lora
from .moe.dispatch import Capacity
from .norm import warmup_grad_norm
from .plan import resolve_plan
from .spec import FSDPTurboEPModelSpec
from .topology import ParallelState, get_parallel_state, initialize_parallel_state
from .weights import checkpoint_fingerprint as weights_fingerprint, load_hf_weights

logger = logging.getLogger(__name__)

__all__ = ["decoder_layers", "fully_shard_outer", "materialize", "reduce_replicated_gradients", "shard_model"]

_DEVICE_OF_BACKEND = {"nccl": "cuda", "hccl": "npu"}


def _info_rank0(message, *args):
    if rank() == 0:
        logger.info(message, *args)


def _default_device(device_type):
    """Where meta tensors are materialised on a mesh of `device_type`: the CPU, or the current
    cuda/npu device."""
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


def _cast_to_storage_dtype(model, bf16):
    """The parameters in the storage dtype: bf16 with `bf16: true`, else float32."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    _info_rank0("Using %s for FSDPTurbo full tuning.", dtype)
    return model.to(dtype)


def _apply_expert_sharding(model, config, topology, ep_mesh, efsdp_mesh, *, efsdp_of_size_one=True,
                           parallelize=expert_parallelize_modules, fully_shard=expert_fully_shard_modules):
    """The expert-sharding step both engines share: the model type's prepare function (when its
    `FSDPTurboEPModelSpec` has one), the plan of `config` (a `TrainConfig`) on `topology` (a
    `ParallelState`) from the Rust core, then with ep > 1 `parallelize` (expert parallelism over
    `ep_mesh`) and `fully_shard` (EFSDP over `efsdp_mesh`: the plan's units; at efsdp = 1 the
    expert modules alone, so that their gradients are reduced by FSDP2, unless
    `efsdp_of_size_one` is False, as LlamaFactory does, leaving the reduction to expert
    parallelism). PEFT's wrappers of expert weights are taken over first (`fsdpturbo.moe.expert_lora`).
    Returns (model, plan, the parameters the outer FSDP2 ignores)."""
    dist_config = config.values["dist"]
    spec = FSDPTurboEPModelSpec.get(model)
    model = spec.prepare(model) if spec is not None else model
    if topology.ep_size > 1:
        expert_lora.take_over(model)  # the plan sees the expert modules themselves
    plan = resolve_plan(model, config, topology)
    for warning in plan["warnings"]:
        logger.warning("fsdpturbo plan: %s", warning)
    expert_names = [m["name"] for m in plan["ep_modules"]]
    if expert_names:
        efsdp_units = plan["efsdp_modules"] or (expert_names if efsdp_of_size_one else [])
        if ep_mesh is None:
            raise RuntimeError("FSDPTurbo EP mesh is not initialized.")
        if efsdp_units and efsdp_mesh is None:
            raise RuntimeError("FSDPTurbo EFSDP mesh is not initialized.")
        ep_plan = EPPlanConfig(apply_modules=expert_names, dispatcher=dist_config["ep_dispatcher"],
                               apply_efsdp_modules=efsdp_units, gradient_divide_factor=plan["gradient_divide_factor"],
                               capacity=Capacity.from_dist_config(dist_config))
        _info_rank0("Applying FSDPTurbo EP backend.")
        _info_rank0("FSDPTurbo EP modules: %s", ep_plan.apply_modules)
        _info_rank0("FSDPTurbo EP device mesh: %s", ep_mesh)
        _info_rank0("FSDPTurbo EP gradient divide factor: %s", ep_plan.gradient_divide_factor)
        model = parallelize(model, ep_mesh, ep_plan)
        if efsdp_units:
            fsdp_plan = FSDPPlanConfig(apply_modules={}, hook_modules=dist_config["hook_modules"] if plan["efsdp_modules"]
                                       else [], fsdp_implementation=dist_config["fsdp_implementation"])
            _info_rank0("FSDPTurbo EFSDP modules: %s", ep_plan.apply_efsdp_modules)
            _info_rank0("FSDPTurbo EFSDP device mesh: %s", efsdp_mesh)
            model = fully_shard(model, efsdp_mesh, ep_plan, fsdp_plan)
    params = dict(model.named_parameters())  # after EP, which replaced the expert parameters
    ignored = [params[name] for name in plan["ignored_params"]]
    if ignored:
        _info_rank0("FSDPTurbo FSDP2: Ignoring %d EP parameters in outer FSDP.", len(ignored))
    return model, plan, ignored


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
    reduce_replicated_gradients(model, [p for p in ignored_params if not isinstance(p, DTensor)], factor)
    return model


def _reduce_hook(grad, factor):
    grad = grad.clone()
    dist.all_reduce(grad, op=dist.ReduceOp.SUM)
    return grad.div_(factor)


class _ReplicatedGradients:
    """A forward pre-hook of the model that gives the parameters `names` the reduction of
    `reduce_replicated_gradients` on whichever Parameter objects the model holds at that
    forward: materialising from meta (`to_empty`) or loading weights replaces them after
    wrapping, and a tensor hook does not move to the new object."""

    MARK = "_fsdpturbo_gradient_reduced"

    def __init__(self, names, factor):
        self.names, self.factor = names, float(factor)

    def __call__(self, model, args):
        params = dict(model.named_parameters())
        for param in (params[n] for n in self.names):
            if param.requires_grad and not hasattr(param, self.MARK):
                param.register_hook(functools.partial(_reduce_hook, factor=self.factor))
                setattr(param, self.MARK, True)


def reduce_replicated_gradients(model, params, factor):
    """For parameters of `model` kept whole on every rank outside any FSDP2 unit
    (`fsdp_ignored_modules`): each backward's incoming gradient is summed over all ranks and
    divided by `factor` before it is accumulated (correct under gradient accumulation), also
    after the parameters are materialised or reloaded."""
    ids = {id(p) for p in params}
    names = [n for n, p in model.named_parameters() if id(p) in ids]
    if names:
        model.register_forward_pre_hook(_ReplicatedGradients(names, factor))


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
        # Each rank reads its own slices, with no collective until the end: a read that fails on
        # one rank (EIO, a file replaced since the fingerprint) fails on every rank, naming it.
        names = []
        collective_step(f"loading the weights {str(weights)!r}",
                        lambda: names.extend(load_hf_weights(model, weights, **({"copy_fn": copy_fn} if copy_fn else {}))))
        loaded = set(names)
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
        dcp_path = config.values["dist"]["dcp_path"]
        sources = {}
        if weights is not None:
            sources["weights checkpoint"] = weights_fingerprint(weights)
        if dcp_path:
            sources["dist_config.dcp_path checkpoint"] = dcp_fingerprint(dcp_path)
        return sources

    sources = collective_step("shard_model: reading the training configuration and checkpoints", read, ValueError)
    return parsed["config"], sources[rank()]


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

    Load balancing (`fsdpturbo.moe.balance`, `fsdpturbo.moe.expert_bias`): a Qwen3-MoE / Qwen3.5-MoE
    model computes its aux loss as `dist_config.aux_loss_scope` says (default: over the global
    batch) and adds the router z-loss when `router_z_loss_coef` > 0; with
    `expert_bias_update_rate` (ep > 1) every EP router gets an expert bias for top-k selection,
    moved by `fsdpturbo.update_expert_bias(model)` once per optimizer step.

    `state`: a `ParallelState` with torch meshes (default: the process-global one, else one
    made from `train_config` for the current world and made global). `device`: where meta
    tensors are materialised (default: the mesh device, the current one for cuda/npu).

    A PEFT model is sharded through the model inside it and returned as itself; with ep > 1 its
    LoRA adapters on the experts (`target_parameters`) move onto the expert modules first
    (`fsdpturbo.moe.expert_lora`).

    Collective: every rank calls it with the same arguments."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    given, model = model, expert_lora.inner_model(model)
    config, sources = _read_inputs(train_config, weights)
    cfg = config.values
    check_same_on_every_rank({"training configuration": cfg, "model structure": model_structure(model), **sources},
                             "shard_model")
    dist_config = cfg["dist"]
    dcp_path = dist_config["dcp_path"]
    if dcp_path and weights is not None:
        raise ValueError(f"fsdpturbo: both dist_config.dcp_path ({dcp_path!r}) and weights=({weights!r}) give the "
                         f"initial weights; pass one")
    model = _cast_to_storage_dtype(model, cfg["bf16"])
    device_type = torch.device(device).type if device is not None else \
        _DEVICE_OF_BACKEND.get(dist.get_backend(), "cpu")
    state = state or _state_for(config, device_type)
    device = torch.device(device) if device is not None else _default_device(device_type)
    model, plan, ignored = _apply_expert_sharding(model, config, state, state.sub_mesh("ep"), state.sub_mesh("efsdp"))
    factor = plan["gradient_divide_factor"]
    if dist_config["expert_bias_update_rate"] is not None:
        expert_bias.install(model, dist_config["expert_bias_update_rate"])
    balance.install(model, scope=dist_config["aux_loss_scope"], z_coef=dist_config["router_z_loss_coef"],
                    factor=factor, device=device, cp_size=state.cp_size)
    fully_shard_outer(model, state.sub_mesh("dp"), factor, ignored_params=ignored,
                      reshard_after_forward=dist_config["reshard_after_forward"],
                      offload_policy=CPUOffloadPolicy(pin_memory=dist_config["pin_memory"])
                      if dist_config["offload_params"] else None)
    materialize(model, device, weights, dcp_path=dcp_path)
    warmup_grad_norm(model)
    adapters.guard_taken_over(given, model)
    return given
