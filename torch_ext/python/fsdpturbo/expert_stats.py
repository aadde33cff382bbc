"""Expert-load statistics: how many tokens each expert of every EP module received.

Every dispatcher counts each rank's rows per expert before its all-to-all (the counts the
split sizes come from). `record` adds this rank's counts into a per-module tensor on the
device — no host sync, no collective — and skips the forward that activation checkpointing
re-runs inside backward, so a recomputed layer is not counted twice. `expert_load` then sums the
tensors of all modules over every rank in one all-reduce: the tokens routed to each expert over
the global batch (every EP and DP rank, every micro-batch) since the last reset, the same on
every rank.
"""
import math

import torch
import torch.distributed as dist

from .recompute import in_recomputation

__all__ = ["add_to_tally", "expert_load", "expert_load_table", "load_summary", "per_expert", "record"]

_COUNTS = "ft_expert_load"
_DROPPED = "ft_expert_dropped"


def per_expert(ids, num_experts):
    """How many of `ids` (any shape, values in [0, num_experts)) name each expert: int64
    [num_experts], a scatter-add whose shape does not depend on the ids (unlike torch.bincount)."""
    flat = ids.reshape(-1).long()
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def record(module, local_counts, dropped=None):
    """Adds this rank's rows per global expert [E] (int64, on the device) to `module`'s tally,
    and `dropped` (those of them the capacity-bounded dispatch dropped) to its drop tally."""
    if in_recomputation():
        return
    add_to_tally(module, _COUNTS, local_counts)
    if dropped is not None:
        add_to_tally(module, _DROPPED, dropped)


def add_to_tally(module, attribute, counts):
    """Adds `counts` into the int64 tally `module.<attribute>` on their device (made at first use)."""
    tally = getattr(module, attribute, None)
    if tally is None or tally.device != counts.device:
        setattr(module, attribute, counts.detach().to(torch.int64).clone())
    else:
        tally.add_(counts.detach())


def _ep_modules(model):
    return [(name, m) for name, m in model.named_modules() if hasattr(m, "num_global_experts")]


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
    modules = _ep_modules(model)
    if not modules:
        raise ValueError("fsdpturbo.expert_load: the model has no expert-parallel module (expert "
                         "parallelism with ep_size > 1 installs them; with ep_size 1 the experts run unchanged)")
    attributes = (_COUNTS, _DROPPED) if with_dropped else (_COUNTS,)
    tallies = [getattr(m, a, None) for a in attributes for _, m in modules]
    device = next((t.device for t in tallies if t is not None), None) or _device_of(model)
    sizes = [m.num_global_experts for _, m in modules] * len(attributes)
    flat = torch.cat([t if t is not None else torch.zeros(e, dtype=torch.int64, device=device)
                      for t, e in zip(tallies, sizes)])
    if dist.is_initialized():
        dist.all_reduce(flat, group=group)
    if reset:
        for tally in tallies:
            if tally is not None:
                tally.zero_()
    names = [name for name, _ in modules]
    parts = flat.cpu().split(sizes)
    loads = dict(zip(names, parts[:len(names)]))
    return (loads, dict(zip(names, parts[len(names):]))) if with_dropped else loads


def load_summary(loads, dropped=None):
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
