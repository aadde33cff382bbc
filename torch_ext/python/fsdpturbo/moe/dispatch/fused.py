"""The fused dispatcher: routing, permutes and the experts' grouped GEMMs in the op library
(`torch.ops.fsdpturbo`, fsdpturbo.moe.dispatch.kernels.OP_LIBRARY: host kernels on CPU;
NVRTC-compiled kernels and cuBLAS / `torch._grouped_mm` on CUDA), or on Ascend NPUs (and their
test double) the aclnn token permute/unpermute and grouped matmul (seed §5.2, NPU column)."""
import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from ..._native import ops
from ..ep_state import state
from . import device, experts
from .kernels import OP_LIBRARY
from .pipeline import Receive, SortedRoute, SortedStrategy, Strategy, run


class FusedStrategy(SortedStrategy):
    """The op library's kernels: `moe_route` counts and sorts in one pass."""

    kernels = OP_LIBRARY

    @staticmethod
    def count(index, num_experts, ep_size):
        counts, permutation, _ = ops.moe_route(index, num_experts, ep_size)
        return counts, permutation

    def route(self, module, index, receive, permutation, ep_group):
        per_expert = torch.tensor(receive.tokens_per_local_expert, dtype=torch.int64, device=index.device)
        # One rank receives its own rows in send order, already grouped by expert (`moe_route`
        # sorts by expert id): no local reorder.
        local_order = None if dist.get_world_size(ep_group) == 1 else \
            receive.local_order(state(module).num_local_experts, index.device)
        return SortedRoute(permutation=permutation, top_k=index.size(1), receive=receive, local_order=local_order,
                           per_expert=per_expert)


@dataclasses.dataclass
class HostRoute:
    """Routing by expert id with the counts on the host (the NPU kernels and mc2)."""
    index: torch.Tensor                 # the slice's expert ids [t, K]
    receive: Receive
    slot_rows: Optional[torch.Tensor] = None  # set by `permute`: each slot's row, for the combine


class TokenPermuteStrategy(Strategy):
    """The NPU kernels: both permutes by expert id (`aclnnMoeTokenPermute`), both combines by
    slot rows (`aclnnMoeTokenUnpermute`)."""

    def route(self, module, index, receive, kept, ep_group):
        return HostRoute(index=index, receive=receive)

    def permute(self, hidden, route):
        permuted, route.slot_rows = ops.moe_token_permute(hidden.contiguous(), route.index)
        return permuted

    def compute(self, module, received, route, ep_group):
        local, ep_size, dev = state(module).num_local_experts, dist.get_world_size(ep_group), received.device
        local_ids = torch.arange(local, device=dev).repeat(ep_size).repeat_interleave(
            torch.tensor(route.receive.blocks, device=dev))
        grouped, local_rows = ops.moe_token_permute(received, local_ids)
        per_expert = torch.tensor(route.receive.tokens_per_local_expert, dtype=torch.int64, device=dev)
        out = experts.grouped_mlp(module, grouped, per_expert, route.receive.tokens_per_local_expert)
        return ops.moe_token_unpermute(out, local_rows, None)

    def unpermute(self, back, route, weights):
        return ops.moe_token_unpermute(back.contiguous(), route.slot_rows, weights)


FUSED = FusedStrategy()
TOKEN_PERMUTE = TokenPermuteStrategy()


def fused_forward(module, hidden_states, top_k_index, top_k_weights, *, ep_group, fixed_router=False):
    """The fused dispatcher's forward: the NPU kernels for tensors they serve, else the op
    library's routing kernels."""
    strategy = TOKEN_PERMUTE if device.runs_npu_kernels(hidden_states) else FUSED
    return run(strategy, module, hidden_states, top_k_index, top_k_weights, ep_group=ep_group,
               fixed_router=fixed_router)
