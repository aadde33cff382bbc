"""The eager and domino dispatchers: torch reference ops (fsdpturbo.moe.dispatch.kernels.TORCH), the
all-to-all through c10d with autograd, the experts' per-expert loop. Domino is eager on two
slices of the tokens: the second slice's dispatch all-to-all is in flight (async c10d work:
functional collectives wait only when their result is used) while the first slice's experts
run; its results equal eager's."""
import torch

from ..ep_state import state
from .kernels import TORCH
from .pipeline import SortedRoute, SortedStrategy, run


class EagerStrategy(SortedStrategy):
    kernels = TORCH

    def route(self, module, index, receive, kept, ep_group):
        # The permutation: the seed's `sorted`, a stable sort of the flat expert ids.
        local_order = receive.local_order(state(module).num_local_experts, index.device)
        return SortedRoute(permutation=torch.argsort(index.reshape(-1), stable=True), top_k=index.size(1),
                           receive=receive, local_order=local_order)


EAGER = EagerStrategy()


def eager_forward(module, hidden_states, top_k_index, top_k_weights, *, ep_group, fixed_router=False):
    """The eager dispatcher's forward for an expert module prepared by `expert_parallelize_modules`."""
    return run(EAGER, module, hidden_states, top_k_index, top_k_weights, ep_group=ep_group, fixed_router=fixed_router)


def domino_forward(module, hidden_states, top_k_index, top_k_weights, *, ep_group, fixed_router=False):
    """The domino dispatcher's forward: eager on two slices of the tokens."""
    return run(EAGER, module, hidden_states, top_k_index, top_k_weights, ep_group=ep_group, fixed_router=fixed_router,
               slices=2)
