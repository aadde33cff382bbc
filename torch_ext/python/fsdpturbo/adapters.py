"""PEFT adapters in and out of a sharded PEFT model (`shard_model`'s, the LlamaFactory engine's;
adapters on the experts per fsdpturbo.moe.expert_lora), at any layout:

* `save_lora_adapter`: every rank's shards gathered into a standard PEFT adapter directory
  (adapter_config.json + adapter_model.safetensors: PEFT's names and shapes, written by PEFT's
  own `save_pretrained`), which `PeftModel.from_pretrained` loads onto the unsharded model;
* `load_lora_adapter`: such a directory into the sharded model, each rank taking its slices;
* `save_merged_weights`: the full weights with the adapters merged by PEFT
  (`merge_and_unload` on a one-process copy), a Hugging Face checkpoint for inference.

What PEFT writes of a model (the active adapter's factors, `modules_to_save`, ...) is decided by
PEFT itself (`get_peft_model_state_dict`), on placeholders of the model's parameters in PEFT's
names and layout, so the three agree with PEFT by construction.
"""
import copy
import dataclasses
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .moe import expert_lora
from .placement import copy_weights_, gather_full
from .weights import check_files, full_state_dict, meta_parameters

__all__ = ["guard_taken_over", "load_lora_adapter", "save_lora_adapter",
           "save_merged_weights"]

WEIGHTS_FILE = "adapter_model.safetensors"
# The adapter settings that decide the factors' shapes and what they compute: a file must agree.
_MATCHING_SETTINGS = ("peft_type", "r", "lora_alpha", "use_rslora", "use_dora", "rank_pattern", "alpha_pattern",
                      "target_modules", "target_parameters")


def _peft_model(model, what):
    peft = expert_lora.peft_classes()
    if peft is None or not isinstance(model, peft.PeftModel):
        raise TypeError(f"fsdpturbo.{what}: expects a PEFT model (peft.PeftModel, as shard_model returns it), got "
                        f"{type(model).__qualname__}")
    return model


@dataclasses.dataclass(frozen=True)
class _Entry:
    """A tensor of the adapter file: the model's parameter and its PEFT name and layout."""
    param: nn.Parameter
    peft: expert_lora.PeftName


def _peft_shape(param, peft):
    """The shape of `param` (a parameter of the sharded model) in PEFT's layout (`peft`: its `PeftName`)."""
    return tuple(peft.to_peft(torch.empty(param.shape, device="meta")).shape)


def _entries(model):
    """{key in the adapter file: `_Entry`}, in PEFT's order: what PEFT saves of `model`'s active
    adapter, chosen by PEFT on meta placeholders."""
    from peft.utils import get_peft_model_state_dict

    names = expert_lora.peft_names(model)
    placeholders, owners = {}, {}
    for name, param in model.named_parameters():
        peft = names.get(name, expert_lora.PeftName(name))
        placeholder = peft.to_peft(torch.empty(param.shape, dtype=param.dtype, device="meta"))
        placeholders[peft.name], owners[id(placeholder)] = placeholder, _Entry(param, peft)
    kept = get_peft_model_state_dict(model, state_dict=placeholders, adapter_name=model.active_adapter)
    return {key: owners[id(value)] for key, value in kept.items()}


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _is_writer(rank):
    return not dist.is_initialized() or dist.get_rank() == rank


def save_lora_adapter(model, path, rank=0):
    """Saves the active adapter of the PEFT model `model` (sharded or not) as a PEFT adapter
    directory at `path`: each tensor PEFT saves is gathered from every rank's shards
    (collective), in PEFT's layout (expert adapters: `lora_A` [r·E, out], `lora_B` [in, r·E]),
    then rank `rank` writes them with PEFT's `save_pretrained`. Every rank returns `path` after
    the files exist."""
    model = _peft_model(model, "save_lora_adapter")
    state = {}
    for entry in _entries(model).values():
        param = entry.param
        full = gather_full(param) if isinstance(param, DTensor) else param.detach()
        if _is_writer(rank):
            state[entry.peft.name] = entry.peft.to_peft(full).cpu().contiguous()
    if _is_writer(rank):
        expert_lora.peft_save_pretrained(model, os.fspath(path), state_dict=state)
    _barrier()
    return path


def guard_taken_over(given, model):
    """After sharding `model` (the model inside the PEFT model `given`, or `given` itself, as
    `shard_model` and `FSDPTurbo` do): when expert parallelism took expert adapters over
    (`given.save_pretrained` is guarded then: `expert_lora.take_over`), `given.load_state_dict`
    also takes a state dict in PEFT's names and layout of the experts (the one taken before
    sharding, as verl loads it: `...experts.base_layer.lora_A.default.weight`,
    `...experts.base_layer.base_layer.gate_up_proj`) by `_load_peft_layout`."""
    if given is model or not any(expert_lora.expert_lora(m) is not None for m in model.modules()):
        return
    given.register_load_state_dict_pre_hook(_load_peft_layout)


def _load_peft_layout(module, state_dict, prefix, *args):
    """Loads the expert tensors `state_dict` holds in PEFT's names and layout into the engine's
    parameters, then leaves each under the engine's name (so `load_state_dict` counts it loaded
    and copies it onto itself) and drops the PEFT key. Collective whenever the process group has
    more than one rank, because that is how sharded models are loaded (torch's
    `set_model_state_dict(..., broadcast_from_rank0=True)` gives the other ranks only the keys
    the model has): rank 0's values are broadcast, the other ranks' ignored, and a wrong shape
    raises on every rank, naming the tensor."""
    names = expert_lora.peft_names(module)
    params = dict(module.named_parameters())
    found = [(ours, tuple(state_dict[prefix + peft.name].shape), state_dict[prefix + peft.name].dtype)
             for ours, peft in names.items() if prefix + peft.name in state_dict]
    collective = dist.is_initialized() and dist.get_world_size() > 1
    if collective:
        shared = [found]
        dist.broadcast_object_list(shared, src=0)
        found = shared[0]
    for ours, shape, _ in found:
        expected = _peft_shape(params[ours], names[ours])
        if shape != expected:
            raise ValueError(f"fsdpturbo: the state dict's {prefix}{names[ours].name} has shape {shape}; "
                             f"{prefix}{ours} takes {expected} in PEFT's layout")
    for ours, shape, dtype in found:
        param, key = params[ours], prefix + names[ours].name
        value = state_dict.pop(key, None)
        if collective:
            local = param.to_local() if isinstance(param, DTensor) else param
            full = value.to(local.device) if dist.get_rank() == 0 else torch.empty(shape, dtype=dtype,
                                                                                   device=local.device)
            dist.broadcast(full, src=0)
            value = full
        copy_weights_(param, names[ours].from_peft(value).contiguous())
        state_dict[prefix + ours] = param


def _check_config(model, path):
    """Raises ValueError naming the first setting in which the adapter at `path` (its config read
    by PEFT) differs from the model's active adapter."""
    from peft import PeftConfig

    saved = PeftConfig.from_pretrained(os.fspath(path))
    ours = model.peft_config[model.active_adapter]
    for setting in _MATCHING_SETTINGS:
        mine, theirs = getattr(ours, setting, None), getattr(saved, setting, None)
        if mine != theirs:
            raise ValueError(f"fsdpturbo.load_lora_adapter: the adapter {os.fspath(path)!r} has {setting} = "
                             f"{theirs!r}, the model's adapter {model.active_adapter!r} has {mine!r}")


def load_lora_adapter(model, path):
    """Loads the PEFT adapter directory at `path` (`save_lora_adapter`'s, PEFT's own, saved at
    any layout or by one process) into the active adapter of the PEFT model `model`, sharded
    or not: each rank copies its slices. The adapter must have the model's settings (rank,
    alpha, targets: ValueError naming the setting) and exactly the tensors PEFT saves of the
    model, each in its shape (KeyError listing the missing and unexpected keys, ValueError
    naming the tensor and both shapes), checked before anything is copied. The file's header
    is validated before it is read; reading it runs no code. Returns the keys loaded."""
    from safetensors.torch import load_file

    model = _peft_model(model, "load_lora_adapter")
    _check_config(model, path)
    file = os.path.join(os.fspath(path), WEIGHTS_FILE)
    check_files(file)
    tensors = load_file(file)
    entries = _entries(model)
    missing, unexpected = sorted(set(entries) - set(tensors)), sorted(set(tensors) - set(entries))
    if missing or unexpected:
        raise KeyError(f"fsdpturbo.load_lora_adapter: {file!r} does not hold the model's adapter: missing "
                       f"{missing}, unexpected {unexpected}")
    for key, entry in entries.items():
        expected = _peft_shape(entry.param, entry.peft)
        if tuple(tensors[key].shape) != expected:
            raise ValueError(f"fsdpturbo.load_lora_adapter: {file!r}: tensor {key!r} has shape "
                             f"{tuple(tensors[key].shape)}; the model's {entry.peft.name} takes {expected}")
    for key, entry in entries.items():
        copy_weights_(entry.param, entry.peft.from_peft(tensors[key]).contiguous())
    return list(entries)


def _one_process_model(model):
    """An unsharded PEFT model of `model`'s architecture and adapter, its parameters on meta."""
    from peft import get_peft_model

    inner = model.get_base_model()
    with meta_parameters():
        base = type(inner)(inner.config)
    return get_peft_model(base, copy.deepcopy(model.peft_config[model.active_adapter]),
                          adapter_name=model.active_adapter)


def save_merged_weights(model, path, rank=0):
    """Saves the PEFT model `model` (sharded or not) with its active adapter merged into the
    weights, as a Hugging Face checkpoint directory at `path` for inference: the full state dict
    is gathered (collective) onto rank `rank`, which loads it into a one-process copy of the
    PEFT model (holding the whole model in its memory once), merges the adapters with PEFT's
    `merge_and_unload` and writes the result with the model's `save_pretrained`. Every rank
    returns `path` after the files exist."""
    model = _peft_model(model, "save_merged_weights")
    state = full_state_dict(model, rank=rank)
    if _is_writer(rank):
        one = _one_process_model(model)
        one.load_state_dict(expert_lora.to_peft(model, state), strict=True, assign=True)
        one.merge_and_unload().save_pretrained(os.fspath(path))
    _barrier()
    return path
