"""The eager and domino dispatchers: torch reference ops, the all-to-all through c10d with
autograd, the experts' per-expert loop. Domino is eager on two slices of the tokens: the second
slice's dispatch all-to-all is in flight (async c10d work: functional collectives wait only when
their result is used) while the first slice's experts run; its results equal eager's."""
import dataclasses

import torch

from . import experts
from .pipeline import Receive, Strategy, inverse, run


@dataclasses.dataclass
class Route:
    sorted_index: torch.Tensor          # stable sort of the flat expert ids (the seed's `sorted`)
    top_k: int
    receive: Receive
    local_order: torch.Tensor           # receive order → local-expert-major (the second sort)


class EagerStrategy(Strategy):
    def route(self, module, index, receive, kept, ep_group):
        return Route(sorted_index=torch.argsort(index.reshape(-1), stable=True), top_k=index.size(1), receive=receive,
                     local_order=receive.local_order(module.num_local_experts, index.device))

    def permute(self, hidden, route):
        return hidden.index_select(0, route.sorted_index // route.top_k)

    def compute(self, module, received, route, ep_group):
        grouped = received.index_select(0, route.local_order)
        out = experts.mlp_loop(module, grouped, route.receive.tokens_per_local_expert)
        return out.index_select(0, inverse(route.local_order))

    def unpermute(self, back, route, weights):
        tokens, top_k = weights.shape
        return weighted_sum(back.index_select(0, inverse(route.sorted_index)).view(tokens, top_k, back.size(-1)), weights)


def weighted_sum(per_slot, weights):
    """Each token's rows [T, K, H] combined with the router's weights [T, K]: the sum over k in
    f32 (f64 for f64), rounded once, which is the fused kernel's arithmetic."""
    acc = torch.float64 if per_slot.dtype == torch.float64 else torch.float32
    return (per_slot.to(acc) * weights.unsqueeze(-1).to(acc)).sum(1).to(per_slot.dtype)


EAGER = EagerStrategy()


def eager_forward(module, hidden_states, top_k_index, top_k_weights, *, ep_group, fixed_router=False):
    """The eager dispatcher's forward for an expert module prepared by `expert_parallelize_modules`."""
    return run(EAGER, module, hidden_states, top_k_index, top_k_weights, ep_group=ep_group, fixed_router=fixed_router)


def domino_forward(module, hidden_states, top_k_index, top_k_weights, *, ep_group, fixed_router=False):
    """The domino dispatcher's forward: eager on two slices of the tokens."""
    return run(EAGER, module, hidden_states, top_k_index, top_k_weights, ep_group=ep_group, fixed_router=fixed_router,
               slices=2)
