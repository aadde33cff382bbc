"""The expert kernels a dispatcher runs with, the same in its dropless and capacity-bounded modes:
torch's reference ops (`TORCH`: the eager and domino dispatchers) or the op library's
(`OP_LIBRARY`: fused). Each gathers token rows (`permute`), combines rows into tokens
(`unpermute`), runs the local experts on rows grouped by local expert (`mlp`) or on a padded
batch of equally many rows per expert (`padded_mlp`), and, for the capacity-bounded mode, copies
each token once per slot (`slot_rows`) and combines each token's slots (`combine_slots`)."""
import functools

import torch

from ..._native import ops
from . import experts


def weighted_sum(per_slot, weights):
    """Each token's rows [T, K, H] combined with the router's weights [T, K]: the sum over k in
    f32 (f64 for f64), rounded once, which is the fused kernel's arithmetic."""
    acc = torch.float64 if per_slot.dtype == torch.float64 else torch.float32
    return (per_slot.to(acc) * weights.unsqueeze(-1).to(acc)).sum(1).to(per_slot.dtype)


def _batched_linear(x, weight):
    return torch.bmm(x, weight.transpose(1, 2))


def inverse(permutation):
    out = torch.empty_like(permutation)
    out[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return out


class TorchKernels:
    """torch's ops: index gathers, the per-expert loop of matmuls, batched matmuls."""

    @staticmethod
    def permute(x, rows, row_divisor):
        """out[i] = x[rows[i] // row_divisor]."""
        return x.index_select(0, rows if row_divisor == 1 else rows // row_divisor)

    @staticmethod
    def unpermute(y, permutation, weights, tokens, top_k):
        """Row `permutation[i]` of the result's slots is y[i]; with `weights` [T, K], each token's
        K slots combined (without: top_k 1, the rows put back in order)."""
        rows = y.index_select(0, inverse(permutation))
        return rows if weights is None else weighted_sum(rows.view(tokens, top_k, y.size(-1)), weights)

    @staticmethod
    def mlp(module, grouped, per_expert, tokens_per_local_expert):
        return experts.mlp_loop(module, grouped, tokens_per_local_expert)

    @staticmethod
    def padded_mlp(module, x):
        """The local experts' MLP on [L, rows, H] (every expert the same number of rows, empty
        ones zero) as batched matmuls."""
        gate_up, down = experts.expert_projections(module)
        return down(experts.activation(module, gate_up(x, _batched_linear)), _batched_linear)

    @staticmethod
    def slot_rows(hidden, top_k):
        return hidden.unsqueeze(1).expand(-1, top_k, -1).reshape(hidden.size(0) * top_k, hidden.size(1))

    @staticmethod
    def combine_slots(per_slot, weights):
        tokens, top_k = weights.shape
        return weighted_sum(per_slot.view(tokens, top_k, per_slot.size(-1)), weights)


class OpLibraryKernels:
    """The op library's kernels (`torch.ops.fsdpturbo`): `moe_permute`, `moe_unpermute`,
    `grouped_mm`."""

    @staticmethod
    def permute(x, rows, row_divisor):
        return ops.moe_permute(x.contiguous(), rows, row_divisor)

    @staticmethod
    def unpermute(y, permutation, weights, tokens, top_k):
        return ops.moe_unpermute(y.contiguous(), permutation, weights, tokens, top_k)

    @staticmethod
    def mlp(module, grouped, per_expert, tokens_per_local_expert):
        return experts.grouped_mlp(module, grouped, per_expert, tokens_per_local_expert)

    @staticmethod
    def padded_mlp(module, x):
        """The grouped matmul over the [L, rows, H] batch on CPU; elsewhere torch's batched
        matmuls, as the op library's grouped matmul reads its counts on the host there."""
        if x.device.type != "cpu":
            return TorchKernels.padded_mlp(module, x)
        gate_up, down = experts.expert_projections(module)
        local, rows, width = x.shape
        linear = functools.partial(experts.grouped_linear, counts=torch.full((local,), rows, dtype=torch.int64))
        return down(experts.activation(module, gate_up(x.reshape(local * rows, width), linear)), linear).view(
            local, rows, -1)

    @staticmethod
    def slot_rows(hidden, top_k):
        slots = torch.arange(hidden.size(0) * top_k, device=hidden.device)
        return OpLibraryKernels.permute(hidden, slots, top_k)

    @staticmethod
    def combine_slots(per_slot, weights):
        tokens, top_k = weights.shape
        slots = torch.arange(tokens * top_k, device=per_slot.device)
        return OpLibraryKernels.unpermute(per_slot, slots, weights, tokens, top_k)


TORCH = TorchKernels()
OP_LIBRARY = OpLibraryKernels()
