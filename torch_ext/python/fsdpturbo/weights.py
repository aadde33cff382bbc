"""Weights: building a model with parameters on meta, loading a Hugging Face safetensors
checkpoint into a sharded model (every parameter through `copy_weights_`, DTensor-exact), and
gathering and saving the full state dict back in Hugging Face's format.

Checkpoint names are the model's parameter names, or for fused expert weights
(`…experts.gate_up_proj` [E, 2I, H], `…experts.down_proj` [E, H, I]) the per-expert layout
Hugging Face writes (`…experts.{e}.gate_proj.weight` then `.up_proj.weight` concatenated on
dim 0; `…experts.{e}.down_proj.weight`), the layout of the Qwen MoE families.
"""
import contextlib
import json
import logging
import os

import torch
import torch.distributed as dist
from torch import nn

from .placement import copy_weights_, gather_full

logger = logging.getLogger(__name__)

__all__ = ["load_hf_weights", "full_state_dict", "meta_parameters", "save_hf_weights"]


@contextlib.contextmanager
def meta_parameters():
    """Within this context, modules create their parameters on the meta device and their
    buffers as usual (real, e.g. rotary frequencies), like accelerate's
    `init_empty_weights()`: build the model here, then `shard_model(..., weights=...)`."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def checkpoint_files(path):
    """The safetensors files of a checkpoint: `path` itself, or in a directory the files of
    `model.safetensors.index.json`, else `model.safetensors`, else every `*.safetensors`."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"fsdpturbo: checkpoint {path!r} is neither a safetensors file nor a directory")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            return [os.path.join(path, name) for name in sorted(set(json.load(f)["weight_map"].values()))]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"fsdpturbo: no .safetensors file in {path!r} (only safetensors checkpoints "
                                f"are read)")
    return files


class _Checkpoint:
    def __init__(self, path):
        from safetensors import safe_open

        self.files = [safe_open(f, framework="pt") for f in checkpoint_files(path)]
        self.where = {key: f for f in self.files for key in f.keys()}
        self.used = set()

    def get(self, key):
        self.used.add(key)
        return self.where[key].get_tensor(key)

    def sources(self, name, num_rows):
        """The keys holding model tensor `name`: its own key (a str), or per expert the keys
        concatenated into its row (the per-expert layout); None when the checkpoint has neither."""
        if name in self.where:
            return name
        prefix, _, leaf = name.rpartition(".")
        parts = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}.get(leaf)
        if parts is None or not num_rows:
            return None
        keys = [[f"{prefix}.{e}.{part}.weight" for part in parts] for e in range(num_rows)]
        return keys if all(k in self.where for row in keys for k in row) else None

    def tensor(self, sources):
        if isinstance(sources, str):
            return self.get(sources)
        return torch.stack([torch.cat([self.get(k) for k in row]) for row in sources])


def load_hf_weights(model, path, copy_fn=copy_weights_):
    """Loads the checkpoint at `path` (a safetensors file or a Hugging Face model directory)
    into `model`'s parameters and persistent buffers, each through `copy_fn(param, full)`
    (default `copy_weights_`: this rank's DTensor slice, cast to the parameter's dtype).
    Every parameter must be found (KeyError listing the missing ones, raised on every rank
    before anything is copied); checkpoint keys the model does not use are logged. Returns
    the names loaded."""
    checkpoint = _Checkpoint(path)
    params = [(name, p, checkpoint.sources(name, p.shape[0] if p.dim() else 0)) for name, p in model.named_parameters()]
    missing = [name for name, _, sources in params if sources is None]
    if missing:
        raise KeyError(f"fsdpturbo: the checkpoint {os.fspath(path)!r} holds no value for the parameters "
                       f"{missing}")
    loaded = []
    for name, param, sources in params:
        copy_fn(param, checkpoint.tensor(sources))
        loaded.append(name)
    persistent = {n for n, _ in _persistent_buffers(model)}
    for name, buffer in model.named_buffers():
        if name in persistent and name in checkpoint.where:
            copy_fn(buffer, checkpoint.get(name))
            loaded.append(name)
    unused = sorted(set(checkpoint.where) - checkpoint.used)
    if unused:
        logger.info("fsdpturbo: %d checkpoint tensors are not used by the model: %s", len(unused), unused[:8])
    return loaded


def _persistent_buffers(model):
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buffer


def full_state_dict(model, device="cpu", rank=None):
    """The full (unsharded) parameters and persistent buffers of `model` by name, on `device`,
    each DTensor gathered with `gather_full` (bitwise equal to `full_tensor()`). Collective:
    every rank calls it; every rank gets the whole dict, or with `rank` only that rank (the
    others get {} and hold one tensor at a time)."""
    from torch.distributed.tensor import DTensor

    keep = rank is None or not dist.is_initialized() or dist.get_rank() == rank
    out = {}
    for name, tensor in list(model.named_parameters()) + list(_persistent_buffers(model)):
        full = gather_full(tensor) if isinstance(tensor, DTensor) else tensor.detach().clone()
        if keep:
            out[name] = full.to(device)
    return out


def save_hf_weights(model, path, rank=0):
    """Saves `model` (sharded or not) as a Hugging Face checkpoint directory at `path`: the full
    state dict is gathered on every rank (collective), then rank `rank` writes it with the
    model's own `save_pretrained(path, state_dict=...)` (its config and Hugging Face's on-disk
    layout, e.g. per-expert weights). Every rank returns `path` after the files exist."""
    state = full_state_dict(model, rank=rank)
    if not dist.is_initialized() or dist.get_rank() == rank:
        model.save_pretrained(os.fspath(path), state_dict=state)
    if dist.is_initialized():
        dist.barrier()
    return path
