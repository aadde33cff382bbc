"""Expert-load statistics: how many tokens each expert of every EP module received.

Every dispatcher counts each rank's rows per expert before its all-to-all (the counts the
split sizes come from). `record` adds this rank's counts into the module's tally on the device
(`fsdpturbo.moe.ep_state.Tally`) — no host sync, no collective — and skips the forward that
activation checkpointing re-runs inside backward, so a recomputed layer is not counted twice.
The one tally serves two readers, each summing what it reads over every rank in one all-reduce
(`reduce_tallies`) and resetting it: `expert_load`, the tokens routed to each expert over the
global batch (every EP and DP rank, every micro-batch) since its last reset, the same on every
rank; and `fsdpturbo.update_expert_bias`, those of the training forwards since the last update.
"""
import math
import warnings

import torch
import torch.distributed as dist

from .ep_state import ep_modules, state
from .recompute import in_recomputation

__all__ = ["expert_load", "expert_load_summary", "expert_load_table", "load_summary", "per_expert", "record",
           "reduce_tallies"]


def per_expert(ids, num_experts):
    """How many of `ids` (any shape, values in [0, num_experts)) name each expert: int64
    [num_experts], a scatter-add whose shape does not depend on the ids (unlike torch.bincount)."""
    flat = ids.reshape(-1).long()
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def record(module, local_counts, dropped=None):
    """Adds this rank's rows per global expert [E] (int64, on the device) to the tally of EP
    module `module`: to what every forward routed and, in a training forward (grad enabled), to
    what the training forwards routed; and `dropped` (those of them the capacity-bounded
    dispatch dropped) to its drops."""
    if in_recomputation():
        return
    tally = state(module).tally
    if tally.counts is None or tally.counts.device != local_counts.device:
        tally.counts = torch.zeros((len(tally.WINDOWS), local_counts.numel()), dtype=torch.int64,
                                   device=local_counts.device)
    tally.window("routed").add_(local_counts)
    if dropped is not None:
        tally.window("dropped").add_(dropped)
    if torch.is_grad_enabled():
        tally.window("trained").add_(local_counts)


def reduce_tallies(tallies, windows, sizes, device, *, group=None, reset=True):
    """The counts `windows` (`Tally.WINDOWS` names) of `tallies` (one per module, `sizes` its
    experts), summed over every rank of `group` (default: the world) in one all-reduce: an int64
    tensor on `device`, window-major, then module by module (zeros for what was never counted).
    `reset`: zero what was read. Collective."""
    counted = [tally.window(window) for window in windows for tally in tallies]
    flat = torch.cat([t.to(device) if t is not None else torch.zeros(e, dtype=torch.int64, device=device)
                      for t, e in zip(counted, sizes * len(windows))])
    if dist.is_initialized():
        dist.all_reduce(flat, group=group)
    if reset:
        for counts in counted:
            if counts is not None:
                counts.zero_()
    return flat


def _device_of(model):
    """Where the collective runs when no forward has recorded yet: the parameters' device."""
    device = next(model.parameters()).device
    return torch.device("cpu") if device.type == "meta" else device


def expert_load(model, *, reset=True, group=None, with_dropped=False):
    """{EP module name: int64 tensor [E] on the CPU}: tokens routed to each expert of the module
    (a token counts once per expert of its top-k) since the last reset, summed over every rank
    of `group` (default: the world) in one all-reduce. The same on every rank; collective.
    `reset`: start the next count from zero. `with_dropped`: also return, in the same form, the
    routed tokens the capacity-bounded dispatch dropped (zeros for a dropless module)."""
    modules = ep_modules(model)
    if not modules:
        raise ValueError("fsdpturbo.expert_load: the model has no expert-parallel module (expert "
                         "parallelism with ep_size > 1 installs them; with ep_size 1 the experts run unchanged)")
    tallies = [state(m).tally for _, m in modules]
    windows = ("routed", "dropped") if with_dropped else ("routed",)
    device = next((t.counts.device for t in tallies if t.counts is not None), None) or _device_of(model)
    sizes = [state(m).num_global_experts for _, m in modules]
    parts = reduce_tallies(tallies, windows, sizes, device, group=group, reset=reset).cpu().split(sizes * len(windows))
    names = [name for name, _ in modules]
    loads = dict(zip(names, parts[:len(names)]))
    return (loads, dict(zip(names, parts[len(names):]))) if with_dropped else loads


def expert_load_summary(loads, dropped=None):
    """Figures a trainer can log, from `expert_load`'s result: per module `{name}/max_over_mean`
    and `{name}/cv` (coefficient of variation), and over all modules `tokens`, `max_over_mean`
    (the worst module's), `cv` (the mean) and `idle_experts` (experts that got no token); with
    `dropped` (`expert_load(..., with_dropped=True)`), `dropped_tokens` and `dropped_fraction`."""
    out, ratios, cvs, idle, tokens = {}, [], [], 0, 0
    for name, load in loads.items():
        counts = load.double()
        mean = counts.mean().item()
        ratio = counts.max().item() / mean if mean else 0.0
        cv = counts.std(unbiased=False).item() / mean if mean else 0.0
        out[f"{name}/max_over_mean"], out[f"{name}/cv"] = ratio, cv
        ratios.append(ratio)
        cvs.append(cv)
        idle += int((load == 0).sum())
        tokens += int(load.sum())
    out.update(tokens=tokens, max_over_mean=max(ratios, default=0.0),
               cv=sum(cvs) / len(cvs) if cvs else 0.0, idle_experts=idle)
    if dropped is not None:
        drops = sum(int(d.sum()) for d in dropped.values())
        out.update(dropped_tokens=drops, dropped_fraction=drops / tokens if tokens else 0.0)
    return out


def load_summary(loads, dropped=None):
    """The former name of `expert_load_summary` (deprecated: it read like a checkpoint's)."""
    warnings.warn("fsdpturbo.load_summary is deprecated: use fsdpturbo.expert_load_summary", DeprecationWarning,
                  stacklevel=2)
    return expert_load_summary(loads, dropped)


_SHADES = " ░▒▓█"


def expert_load_table(loads, *, width=None):
    """A heat map to print (layers down, experts across): each cell shades an expert's load
    relative to twice its layer's mean (full block: ≥ 2× the mean; blank: idle), with each
    layer's max/mean at the end of its row. `width` caps the experts shown (neighbours merged)."""
    lines = []
    label = max((len(n) for n in loads), default=0)
    for name, load in loads.items():
        counts = load.double()
        if width and counts.numel() > width:
            group = math.ceil(counts.numel() / width)
            counts = torch.nn.functional.pad(counts, (0, -counts.numel() % group)).view(-1, group).sum(1)
        mean = counts.mean().item()
        levels = (counts / (2 * mean) * (len(_SHADES) - 1)).ceil().clamp(0, len(_SHADES) - 1) if mean else \
            torch.zeros_like(counts)
        cells = "".join(_SHADES[int(v)] for v in levels)
        ratio = counts.max().item() / mean if mean else 0.0
        lines.append(f"{name:<{label}} |{cells}| max/mean {ratio:.2f}")
    return "\n".join(lines)
