"""The eager and domino dispatchers: torch reference ops, the all-to-all through c10d with
autograd, the experts' per-expert loop. Domino is eager on two slices of the tokens: the second
slice's dispatch all-to-all is in flight (async c10d work: functional collectives wait only when
their result is used) while the first slice's experts run; its results equal eager's."""
import dataclasses
from typing import List

import torch
import torch.distributed as dist

from . import experts
from .pipeline import Strategy, inverse, run


@dataclasses.dataclass
class Route:
    sorted_index: torch.Tensor          # stable sort of the flat expert ids (the seed's `sorted`)
    top_k: int
    input_splits: List[int]             # rows I send to each ep rank
    output_splits: List[int]            # rows I receive from each ep rank
    tokens_per_local_expert: List[int]
    local_order: torch.Tensor           # receive order → local-expert-major (the second sort)


class EagerStrategy(Strategy):
    def route(self, module, index, counts, kept, ep_group):
        ep_size, ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        local = module.num_local_experts
        flat = index.reshape(-1)
        mine = counts[:, ep_rank * local:(ep_rank + 1) * local]                      # [P, L]
        input_splits = counts[ep_rank].view(ep_size, local).sum(1).tolist()         # synchronous host copy
        ids = torch.arange(module.num_global_experts, device=flat.device) % local  # expert_ids_per_ep_rank
        local_expert_of_row = torch.repeat_interleave(ids, mine.reshape(-1))
        return Route(sorted_index=torch.argsort(flat, stable=True), top_k=index.size(1), input_splits=input_splits,
                     output_splits=mine.sum(1).tolist(), tokens_per_local_expert=mine.sum(0).tolist(),
                     local_order=torch.argsort(local_expert_of_row, stable=True))

    def permute(self, hidden, route):
        return hidden.index_select(0, route.sorted_index // route.top_k)

    def compute(self, module, received, route, ep_group):
        grouped = received.index_select(0, route.local_order)
        out = experts.mlp_loop(module, grouped, route.tokens_per_local_expert)
        return out.index_select(0, inverse(route.local_order))

    def unpermute(self, back, route, weights):
        tokens, top_k = weights.shape
        per_slot = back.index_select(0, inverse(route.sorted_index)).view(tokens, top_k, back.size(-1))
        # Weighted sum over k in f32 (f64 for f64), rounded once: the fused kernel's arithmetic.
        acc = torch.float64 if back.dtype == torch.float64 else torch.float32
        return (per_slot.to(acc) * weights.unsqueeze(-1).to(acc)).sum(1).to(back.dtype)


EAGER = EagerStrategy()


def eager_forward(module, hidden_states, top_k_index, top_k_weights, *, ep_group, fixed_router=False):
    """The eager dispatcher's forward for an expert module prepared by `expert_parallelize_modules`."""
    return run(EAGER, module, hidden_states, top_k_index, top_k_weights, ep_group=ep_group, fixed_router=fixed_router)


def domino_forward(module, hidden_states, top_k_index, top_k_weights, *, ep_group, fixed_router=False):
    """The domino dispatcher's forward: eager on two slices of the tokens."""
    return run(EAGER, module, hidden_states, top_k_index, top_k_weights, ep_group=ep_group, fixed_router=fixed_router,
               slices=2)
