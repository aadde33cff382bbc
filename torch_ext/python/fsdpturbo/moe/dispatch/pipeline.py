"""The one dispatch pipeline every dispatcher runs, in each of its modes:

    prepare → counts → route → dispatch → expert compute → combine

`prepare` normalises the router's output; `counts` sizes each slice's exchange, in one of two
ways:

* dropless: count each slice's rows per global expert and all-gather the counts over the EP
  group (this rank's counts go to `fsdpturbo.moe.expert_stats`); the gathered counts are read on the
  host once (ids outside [0, E) then fail on every rank: no rank hangs) and give each slice's
  split sizes (a `Receive`: on the host before any all-to-all, docs/design.md §4.5);
* static shapes (the capacity-bounded mode, fsdpturbo.moe.dispatch.capacity): the strategy sizes
  the exchange itself from a fixed number of rows per expert, reading no count on the host.

A `Strategy` then turns the sizes into routing metadata (`route`), sends the rows to their
experts' ranks (`dispatch`), regroups them by local expert around the expert compute
(`compute`, with the dispatcher's expert kernels, fsdpturbo.moe.dispatch.kernels) and brings them
back, weighted by the router (`combine`). A dispatcher is a strategy and a number of slices:
with two (domino) every slice's dispatch is issued before the first slice's experts run, so the
second all-to-all is in flight meanwhile.
"""
import dataclasses
from typing import List, Optional

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from .. import expert_stats
from ..ep_state import state


def normalize_expert_args(top_k_index, top_k_weights):
    """The seed's argument normalisation: swapped arguments, full router probabilities [T, E]."""
    if torch.is_floating_point(top_k_index):
        top_k_index, top_k_weights = top_k_weights, top_k_index
    if top_k_weights.size() != top_k_index.size():
        top_k_weights = top_k_weights.gather(1, top_k_index)
    return top_k_index, top_k_weights


def fixed_router_for_debug(top_k_index, top_k_weights, num_experts):
    """The seed's debug router: token t, slot k → expert (t + k) % E with weight 1/K."""
    with torch.no_grad():
        if top_k_index.dim() == 1:
            index = torch.arange(top_k_index.numel(), device=top_k_index.device) % num_experts
        else:
            t = torch.arange(top_k_index.size(0), device=top_k_index.device).unsqueeze(1)
            k = torch.arange(top_k_index.size(1), device=top_k_index.device).unsqueeze(0)
            index = (t + k) % num_experts
        weights = torch.full_like(top_k_weights, 1.0 / top_k_index.size(-1))
    return index.to(top_k_index.dtype), weights


def prepare(module, hidden_states, top_k_index, top_k_weights, fixed_router):
    """Tokens [T, H], expert ids [T, K] and their weights [T, K] from the block's arguments."""
    hidden = hidden_states.reshape(-1, hidden_states.size(-1))
    top_k_index, top_k_weights = normalize_expert_args(top_k_index, top_k_weights)
    top_k = top_k_index.size(-1) if top_k_index.dim() > 1 else 1
    top_k_index = top_k_index.reshape(hidden.size(0), top_k)
    top_k_weights = top_k_weights.reshape(hidden.size(0), top_k)
    if fixed_router:
        top_k_index, top_k_weights = fixed_router_for_debug(top_k_index, top_k_weights,
                                                            state(module).num_global_experts)
    return hidden, top_k_index, top_k_weights


def shaped_like(out, hidden_states):
    """`out`, a fresh tensor nothing else refers to, in the shape of `hidden_states` and never a
    view: FSDP2 warns when a wrapped module returns a view (an in-place op on it would skip the
    module's pre-backward hook), and hidden states of [B, S, H] made `out.view` one.
    `_unsafe_view` reshapes without recording `out` as the base, which is safe as nothing else
    aliases it (ATen's own matmul returns its reshaped results the same way)."""
    return out if out.shape == hidden_states.shape else torch.ops.aten._unsafe_view(out, hidden_states.shape)


def gathered_counts(index_per_slice, num_experts, ep_group, count):
    """Each slice's expert counts (`count(index, num_experts, ep_size)` → (counts [E], what the
    strategy keeps of it)), all-gathered over the EP group: ([P, S, E + 1], kept per slice). The
    extra column carries "this rank has out-of-range ids" (counted as expert 0 meanwhile: no host
    read here), so a bad rank fails everywhere instead of leaving the others waiting in the next
    collective."""
    world = dist.get_world_size(ep_group)
    rows, kept = [], []
    for index in index_per_slice:
        out_of_range = (index < 0) | (index >= num_experts)
        counts, keep = count(torch.where(out_of_range, 0, index), num_experts, world)
        rows.append(torch.cat([counts, out_of_range.any().reshape(1).to(counts.dtype)]))
        kept.append(keep)
    local = torch.stack(rows)
    gathered = torch.empty((world * local.size(0), local.size(1)), dtype=local.dtype, device=local.device)
    dist.all_gather_into_tensor(gathered, local, group=ep_group)
    return gathered.view(world, local.size(0), local.size(1)), kept


def bincount(index, num_experts, ep_size):
    """The default count: rows per global expert, nothing kept."""
    return expert_stats.per_expert(index, num_experts), None


def check_ids(flat, top_k, num_experts, host_counts, ep_group):
    """Raises on every rank when any rank of the group routed to an id outside [0, E)
    (`host_counts`: the gathered counts on the host, [P][S][E + 1])."""
    offenders = [p for p, rank_rows in enumerate(host_counts) if any(row[num_experts] for row in rank_rows)]
    if not offenders:
        return
    bad = ((flat < 0) | (flat >= num_experts)).nonzero()
    if bad.numel():
        j = int(bad[0, 0])
        raise ValueError(f"expert id {int(flat[j])} at token {j // top_k}, slot {j % top_k} is outside "
                         f"[0, {num_experts}): top_k_index must hold expert ids of this layer")
    ranks = dist.get_process_group_ranks(ep_group)
    raise ValueError(f"expert ids outside [0, {num_experts}) on rank(s) {[ranks[p] for p in offenders]} of this EP "
                     f"group; every rank of the group stops")


@dataclasses.dataclass
class Receive:
    """What this rank sends and receives, from the gathered counts of one slice on the host."""
    sends: List[int]                    # my rows per global expert
    input_splits: List[int]             # rows I send to each ep rank
    output_splits: List[int]            # rows I receive from each ep rank
    blocks: List[int]                   # rows each rank sends to each of my local experts, [P·L] source-major
    tokens_per_local_expert: List[int]

    @classmethod
    def of(cls, host_counts, ep_rank, local):
        """From the slice's gathered counts [P][E] (Python ints)."""
        ep_size = len(host_counts)
        sends = host_counts[ep_rank]
        blocks = [n for row in host_counts for n in row[ep_rank * local:(ep_rank + 1) * local]]
        return cls(sends=sends, input_splits=[sum(sends[p * local:(p + 1) * local]) for p in range(ep_size)],
                   output_splits=[sum(blocks[p * local:(p + 1) * local]) for p in range(ep_size)], blocks=blocks,
                   tokens_per_local_expert=[sum(blocks[j::local]) for j in range(local)])

    def local_order(self, local, device):
        """The received rows (source-major, each source's rows by local expert) in
        local-expert-major order (stable): a permutation of the received rows."""
        bounds = torch.tensor(self.blocks, dtype=torch.int64, device=device).cumsum(0)
        block = torch.searchsorted(bounds, torch.arange(sum(self.blocks), device=device), right=True)
        return torch.argsort(block % local, stable=True)


def all_to_all(x, output_splits, input_splits, ep_group):
    """The rows' all-to-all over the EP group, with autograd (none with one rank)."""
    if dist.get_world_size(ep_group) == 1:
        return x
    return all_to_all_single_autograd(x, output_splits, input_splits, ep_group)


class Strategy:
    """How one dispatcher does the steps after the counts. `count` (default: bincount) may keep
    what it computed for `route`; `dispatch` and `combine` default to a local permute around the
    all-to-all (`route.receive`: the rows sent to and received from each rank; None: equal
    splits). A strategy with `static_shapes` sizes each slice itself (`static_receive`)."""

    count = staticmethod(bincount)
    static_shapes = False

    def static_receive(self, module, index, ep_group):
        """With static shapes: what this rank sends and receives for a slice with ids [t, K],
        reading no count on the host, and what `route` keeps of it."""
        raise NotImplementedError

    def route(self, module, index, receive, kept, ep_group):
        """Routing metadata of one slice from its ids [t, K], what this rank sends and receives
        (a `Receive`; with static shapes, what `static_receive` gave) and what the counts kept."""
        raise NotImplementedError

    def permute(self, hidden, route):
        """The slice's token rows in the order they are sent (by destination rank)."""
        raise NotImplementedError

    def dispatch(self, hidden, route, ep_group):
        return all_to_all(self.permute(hidden, route), route.receive.output_splits, route.receive.input_splits,
                          ep_group)

    def compute(self, module, received, route, ep_group):
        """The local experts on the received rows; rows in the order they were received."""
        raise NotImplementedError

    def combine(self, y, route, weights, ep_group):
        return self.unpermute(all_to_all(y, route.receive.input_splits, route.receive.output_splits, ep_group), route,
                              weights)

    def unpermute(self, back, route, weights):
        """The returned rows combined into one row per token, weighted by the router."""
        raise NotImplementedError


@dataclasses.dataclass
class SortedRoute:
    """Routing of one slice whose rows are sent sorted by expert id."""
    permutation: torch.Tensor            # the slots (t·K + k) in send order
    top_k: int
    receive: Receive
    local_order: Optional[torch.Tensor]  # receive order → local-expert-major (None: already so)
    per_expert: Optional[torch.Tensor] = None  # rows per local expert, on the device (grouped kernels)


class SortedStrategy(Strategy):
    """The dropless eager, domino and fused strategies: rows sent sorted by expert id, received
    rows regrouped by local expert around the experts, all with the strategy's expert
    `kernels` (fsdpturbo.moe.dispatch.kernels); `route` makes a `SortedRoute`."""

    kernels = None

    def permute(self, hidden, route):
        return self.kernels.permute(hidden, route.permutation, route.top_k)

    def compute(self, module, received, route, ep_group):
        tokens = route.receive.tokens_per_local_expert
        if route.local_order is None:
            return self.kernels.mlp(module, received, route.per_expert, tokens)
        grouped = self.kernels.permute(received, route.local_order, 1)
        out = self.kernels.mlp(module, grouped, route.per_expert, tokens)
        return self.kernels.unpermute(out, route.local_order, None, out.size(0), 1)

    def unpermute(self, back, route, weights):
        tokens, top_k = weights.shape
        return self.kernels.unpermute(back, route.permutation, weights, tokens, top_k)


def run(strategy, module, hidden_states, top_k_index, top_k_weights, *, ep_group, fixed_router=False, slices=1):
    """The forward of an expert module prepared by `expert_parallelize_modules` under `strategy`,
    the tokens in `slices` slices (1, or 2: domino)."""
    hidden, index, weights = prepare(module, hidden_states, top_k_index, top_k_weights, fixed_router)
    tokens = index.size(0)
    if slices == 1:
        parts = [(hidden, index, weights)]
    else:
        size = -(-tokens // slices)
        bounds = [(min(i * size, tokens), min((i + 1) * size, tokens)) for i in range(slices)]
        parts = [(hidden[a:b], index[a:b], weights[a:b]) for a, b in bounds]
    if strategy.static_shapes:
        sized = [strategy.static_receive(module, part[1], ep_group) for part in parts]
        outputs = exchange(strategy, module, parts, [s[0] for s in sized], [s[1] for s in sized], ep_group)
    else:
        num_experts = state(module).num_global_experts
        counts, kept = gathered_counts([p[1] for p in parts], num_experts, ep_group, strategy.count)
        expert_stats.record(module, counts[dist.get_rank(ep_group), :, :num_experts].sum(0))
        outputs = exchange_by_counts(strategy, module, parts, index, counts, kept, ep_group)
    return shaped_like(outputs[0] if len(outputs) == 1 else torch.cat(outputs), hidden_states)


# The dispatch's one host read: the split sizes of the all-to-alls, which must be on the host
# before they start (docs/design.md §4.5). Under torch.compile this runs eagerly (one graph break per
# MoE forward): traced, every new routing's sizes would be specialised into a new graph.
@torch.compiler.disable
def exchange_by_counts(strategy, module, parts, index, counts, kept, ep_group):
    """`exchange` sized by the gathered counts [P, S, E + 1], read on the host."""
    ep_state = state(module)
    num_experts, local = ep_state.num_global_experts, ep_state.num_local_experts
    ep_rank = dist.get_rank(ep_group)
    host_counts = counts.tolist()
    check_ids(index.reshape(-1), index.size(1), num_experts, host_counts, ep_group)
    receives = [Receive.of([row[i][:num_experts] for row in host_counts], ep_rank, local) for i in range(len(parts))]
    return exchange(strategy, module, parts, receives, kept, ep_group)


def exchange(strategy, module, parts, receives, kept, ep_group):
    """Each slice's rows to their experts and back, combined per token: route, dispatch (every
    slice's before the first slice's experts), compute, combine."""
    routes = [strategy.route(module, part[1], receive, keep, ep_group)
              for part, receive, keep in zip(parts, receives, kept)]
    received = [strategy.dispatch(part[0], route, ep_group) for part, route in zip(parts, routes)]
    return [strategy.combine(strategy.compute(module, rows, route, ep_group), route, part[2], ep_group)
            for part, rows, route in zip(parts, received, routes)]
