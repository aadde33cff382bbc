"""The capacity-bounded dispatch (`dist_config.capacity_factor` or `expert_capacity`): the
dispatch pipeline's static-shape mode (`CapacityStrategy`, with the eager or fused
dispatcher's expert kernels), static shapes end to end and no device-to-host copy in forward or
backward, so an EP block compiles with `fullgraph=True` and can be captured in a CUDA graph.

Each rank sends every expert at most C rows: C = `expert_capacity`, or
ceil(capacity_factor · tokens · top_k / experts) from this rank's token count (so with a
factor every rank of an EP group must forward the same number of tokens). A slot's place in
its expert's C rows is its rank among this rank's slots of that expert, in slot order (token
by token, k by k). The send buffer is [E · C, H] (expert-major, so rank p's block is its L
local experts' rows): one all-to-all with equal splits out and one back. The receiving rank
runs its experts on [L, P · C, H], empty rows included (zeros in, zeros out: the expert MLP
has no bias); each token then combines its slots' rows, weighted by the router, exactly as the
dropless dispatchers do.

Slots over capacity follow `capacity_overflow`: `drop` (the slot skips its expert and adds
nothing; counted by `fsdpturbo.expert_load(..., with_dropped=True)`) or `fail` (every rank of
the EP group raises, naming the layer, the expert and each rank's count; this reads one
all-gathered count on the host, so `fail` is not sync-free; compiled, a device-side assert
without the counts). Expert ids outside [0, E) stop the run through a device-side assert (no
host sync; on CPU it raises at once).

With C ≥ every expert's load this equals the dropless dispatch: bitwise `fused` (the same
kernels on the same rows, in the same order), and `eager` up to the GEMM's rounding (a batched
matmul over the padded rows instead of one matmul per expert).
"""
import dataclasses
import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import _functional_collectives as funcol

from .. import expert_stats
from ..ep_state import state
from .pipeline import Strategy, run

OVERFLOW_POLICIES = ("drop", "fail")


@dataclasses.dataclass(frozen=True)
class Capacity:
    """How many rows each expert takes from each rank per forward: `tokens` rows, or
    ceil(`factor` · tokens · top_k / experts) of the forward's own token count; and what
    happens to slots over it (`overflow`: "drop" or "fail")."""
    factor: Optional[float] = None
    tokens: Optional[int] = None
    overflow: str = "drop"

    def __post_init__(self):
        if (self.factor is None) == (self.tokens is None):
            raise ValueError(f"fsdpturbo: a capacity needs exactly one of factor and tokens, got factor={self.factor}, "
                             f"tokens={self.tokens}")
        if self.factor is not None and not (math.isfinite(self.factor) and self.factor > 0):
            raise ValueError(f"fsdpturbo: the capacity factor must be a finite number > 0, got {self.factor}")
        if self.tokens is not None and (isinstance(self.tokens, bool) or not isinstance(self.tokens, int)
                                        or self.tokens < 1):
            raise ValueError(f"fsdpturbo: the expert capacity must be an integer ≥ 1, got {self.tokens!r}")
        if self.overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"fsdpturbo: capacity overflow must be one of {list(OVERFLOW_POLICIES)}, "
                             f"got {self.overflow!r}")

    @classmethod
    def from_dist_config(cls, dist_config):
        """The capacity of a validated `dist_config` dict (`TrainConfig.values["dist"]`), or None
        (dropless)."""
        factor, tokens = dist_config["capacity_factor"], dist_config["expert_capacity"]
        if factor is None and tokens is None:
            return None
        return cls(factor=factor, tokens=tokens, overflow=dist_config["capacity_overflow"])

    def rows(self, tokens, top_k, num_experts):
        """C: the rows each expert takes from one rank in a forward of `tokens` tokens."""
        if self.tokens is not None:
            return self.tokens
        return max(1, math.ceil(self.factor * tokens * top_k / num_experts))


def _slot_places(ids, num_experts):
    """Each slot's place among this rank's slots of its expert (slot order), and the slots per
    expert [E + 1] (the last: ids outside [0, E)). Static shapes: a stable sort and a cumsum."""
    order = torch.argsort(ids, stable=True)
    counts = expert_stats.per_expert(ids, num_experts + 1)
    starts = torch.cumsum(counts, 0) - counts
    place_sorted = torch.arange(ids.numel(), device=ids.device) - starts.index_select(0, ids.index_select(0, order))
    return torch.empty_like(place_sorted).index_copy_(0, order, place_sorted), counts


def _check_overflow(module, counts, capacity_rows, ep_group):
    """`capacity_overflow: fail`: every rank of the EP group raises when any rank sent any
    expert more than C slots (one all-gather of the counts, read on the host)."""
    gathered = funcol.all_gather_tensor(counts, 0, ep_group).view(-1, counts.numel())
    if torch.compiler.is_compiling():  # no layer name: a traced string would specialise each layer's graph
        torch._assert_async((gathered <= capacity_rows).all(),
                            f"fsdpturbo: an expert got more than its capacity of {capacity_rows} rows from a rank "
                            f"(capacity_overflow: fail); run without torch.compile for the layer and the counts")
        return
    over = gathered > capacity_rows
    if not bool(over.any()):
        return
    ranks = dist.get_process_group_ranks(ep_group)
    expert = int(over.any(0).nonzero()[0, 0])
    per_rank = ", ".join(f"rank {ranks[p]}: {int(gathered[p, expert])}" for p in range(gathered.size(0)))
    raise RuntimeError(f"fsdpturbo: {state(module).name}: expert {expert} got more rows than its capacity of "
                       f"{capacity_rows} per rank ({per_rank}); capacity_overflow is 'fail' (raise capacity_factor / "
                       f"expert_capacity, or set capacity_overflow: drop)")


@dataclasses.dataclass
class StaticReceive:
    """What a rank sends and receives when every expert takes C (`rows`) rows from every rank,
    empty ones included: C rows per expert to and from each rank, equal splits known without
    reading a count."""
    rows: int
    input_splits = None  # None: equal splits
    output_splits = None


@dataclasses.dataclass
class SlotRoute:
    """Each slot's row in the send buffer [E · C + 1, H]: expert-major, C rows per expert; a
    dropped slot goes to the spare last row, which is not sent."""
    receive: StaticReceive
    slot_row: torch.Tensor
    top_k: int
    sent_rows: int  # E · C


class CapacityStrategy(Strategy):
    """The capacity-bounded mode of the dispatch pipeline: at most `capacity` rows per expert
    from each rank, with a dispatcher's expert `kernels` (fsdpturbo.moe.dispatch.kernels)."""

    static_shapes = True

    def __init__(self, capacity, kernels):
        self.capacity, self.kernels = capacity, kernels

    def static_receive(self, module, index, ep_group):
        """C for this forward, and each slot's row in the send buffer."""
        tokens, top_k = index.shape
        num_experts = state(module).num_global_experts
        rows = self.capacity.rows(tokens, top_k, num_experts)
        flat = index.reshape(-1).long()
        in_range = (flat >= 0) & (flat < num_experts)
        # The message names no layer: a traced string would specialise each layer's graph.
        torch._assert_async(in_range.all(), f"fsdpturbo: expert ids outside [0, {num_experts}) reached the "
                                            f"capacity-bounded dispatch: top_k_index must hold expert ids of its layer")
        ids = torch.where(in_range, flat, num_experts)
        place, counts = _slot_places(ids, num_experts)
        routed = counts[:num_experts]
        if self.capacity.overflow == "fail":
            _check_overflow(module, routed, rows, ep_group)
        expert_stats.record(module, routed, dropped=routed - routed.clamp(max=rows))
        kept = in_range & (place < rows)
        return StaticReceive(rows), torch.where(kept, ids * rows + place, num_experts * rows)

    def route(self, module, index, receive, slot_row, ep_group):
        return SlotRoute(receive=receive, slot_row=slot_row, top_k=index.size(1),
                         sent_rows=state(module).num_global_experts * receive.rows)

    def permute(self, hidden, route):
        per_slot = self.kernels.slot_rows(hidden, route.top_k)
        send = per_slot.new_zeros((route.sent_rows + 1, hidden.size(1))).index_copy(0, route.slot_row, per_slot)
        return send[:route.sent_rows]

    def compute(self, module, received, route, ep_group):
        """The local experts on [L, P · C, H]: each expert's C rows from every rank."""
        ep_size, local, rows = dist.get_world_size(ep_group), state(module).num_local_experts, route.receive.rows
        width = received.size(1)
        by_expert = received.view(ep_size, local, rows, width).transpose(0, 1).reshape(local, ep_size * rows, width)
        out = self.kernels.padded_mlp(module, by_expert)
        return out.view(local, ep_size, rows, width).transpose(0, 1).reshape(route.sent_rows, width)

    def unpermute(self, back, route, weights):
        return self.kernels.combine_slots(F.pad(back, (0, 0, 0, 1)).index_select(0, route.slot_row), weights)


def capacity_forward(module, hidden_states, top_k_index, top_k_weights, *, ep_group, strategy, fixed_router=False):
    """The forward of an expert module under a capacity-bounded mode (a `CapacityStrategy`)."""
    return run(strategy, module, hidden_states, top_k_index, top_k_weights, ep_group=ep_group,
               fixed_router=fixed_router)
