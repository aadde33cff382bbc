"""Hugging Face's on-disk layout of fused expert weights, in one place.

The Qwen MoE families hold each layer's experts as fused tensors, `…experts.gate_up_proj`
[E, 2I, H] and `…experts.down_proj` [E, H, I], but `save_pretrained` writes them per expert:
`…experts.{e}.gate_proj.weight` and `.up_proj.weight` (concatenated on dim 0 give row e of
`gate_up_proj`) and `…experts.{e}.down_proj.weight`.
"""
import re

import torch

from ._abi import FSDPTURBO_MAX_EXPERTS as MAX_EXPERTS

EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_PER_EXPERT_KEY = re.compile(r"^(?P<experts>.*\.experts)\.(?P<index>\d+)\.(?P<part>\w+)\.weight$")
_PARTS = {part for parts in EXPERT_PARTS.values() for part in parts}


def per_expert_keys(name, num_experts):
    """The per-expert checkpoint keys of fused tensor `name`, one row of keys per expert, or
    None when `name` is not a fused expert tensor. More than MAX_EXPERTS experts (the core's
    limit) is a ValueError: the rows would be sized by a number from a file."""
    prefix, _, leaf = name.rpartition(".")
    parts = EXPERT_PARTS.get(leaf)
    if parts is None or not num_experts:
        return None
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"fsdpturbo: {name!r} would have {num_experts} experts (keys numbered up to "
                         f"{num_experts - 1}), more than the limit of {MAX_EXPERTS}")
    return [[f"{prefix}.{e}.{part}.weight" for part in parts] for e in range(num_experts)]


def fuse(keys):
    """Groups checkpoint `keys` into the tensors of the fused layout: {name: rows of keys} for
    fused expert tensors, {name: name} for every other key. Every expert of a layer must hold
    every part (ValueError naming the first missing key)."""
    fused, experts = {}, {}
    for key in keys:
        match = _PER_EXPERT_KEY.match(key)
        if match and match["part"] in _PARTS:
            experts.setdefault(match["experts"], set()).add(int(match["index"]))
        else:
            fused[key] = key
    present = set(keys)
    for prefix, indices in sorted(experts.items()):
        for leaf in EXPERT_PARTS:
            rows = per_expert_keys(f"{prefix}.{leaf}", max(indices) + 1)
            missing = [k for row in rows for k in row if k not in present]
            if missing:
                raise ValueError(f"fsdpturbo: the per-expert weights of {prefix!r} are incomplete: {missing[0]!r} is "
                                 f"missing ({len(missing)} keys in all)")
            fused[f"{prefix}.{leaf}"] = rows
    return fused


def stack(rows, read):
    """The fused tensor of per-expert `rows` (from `fuse`), reading each key with `read`; each
    row is concatenated straight into its place (no stacked copy)."""
    fused = None
    for expert, row in enumerate(rows):
        parts = [read(key) for key in row]
        if fused is None:
            fused = torch.empty((len(rows), sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=parts[0].dtype)
        torch.cat(parts, out=fused[expert])
    return fused


def split(name, tensor):
    """The per-expert (key, tensor) pairs of fused expert tensor `name` (views of `tensor`), or
    [(name, tensor)] for any other tensor."""
    rows = per_expert_keys(name, tensor.shape[0] if tensor.dim() == 3 else 0)
    if rows is None:
        return [(name, tensor)]
    return [(key, chunk) for row, expert in zip(rows, tensor) for key, chunk in zip(row, expert.chunk(len(row)))]
