"""Autograd and fake (meta) registrations of the MoE ops of the op library: routing,
permute/unpermute (by rows, and the seed's token contract by expert ids) and the experts'
grouped matmul (`torch.ops.fsdpturbo.*`)."""
import torch

from ._native import ops


def _permute_setup(ctx, inputs, output):
    hidden, rows, row_divisor = inputs
    ctx.save_for_backward(rows)
    ctx.tokens, ctx.row_divisor = hidden.size(0), row_divisor


def _permute_backward(ctx, grad):
    # Every token row was gathered row_divisor times (rows is a permutation of the slots):
    # its gradient is the sum of its copies, which is an unpermute without weights.
    (rows,) = ctx.saved_tensors
    return ops.moe_unpermute(grad.contiguous(), rows, None, ctx.tokens, ctx.row_divisor), None, None


def _unpermute_setup(ctx, inputs, output):
    permuted, permutation, probs, tokens, top_k = inputs
    ctx.save_for_backward(permuted, permutation, probs)
    ctx.tokens, ctx.top_k, ctx.has_probs = tokens, top_k, probs is not None


def _unpermute_backward(ctx, grad):
    permuted, permutation, probs = ctx.saved_tensors
    grad = grad.contiguous()
    grad_permuted = ops.moe_permute(grad, permutation, ctx.top_k)
    grad_probs = None
    if ctx.has_probs:
        slot_weight = probs.reshape(-1).index_select(0, permutation).to(grad.dtype)
        grad_permuted = grad_permuted * slot_weight.unsqueeze(-1)
        inverse = torch.empty_like(permutation)
        inverse[permutation] = torch.arange(permutation.numel(), device=permutation.device)
        per_slot = permuted.index_select(0, inverse).view(ctx.tokens, ctx.top_k, -1)
        grad_probs = (per_slot * grad.unsqueeze(1)).sum(-1).to(probs.dtype).view_as(probs)
    return grad_permuted, None, grad_probs, None, None


def _token_permute_setup(ctx, inputs, output):
    tokens, indices = inputs
    ctx.save_for_backward(output[1])
    ctx.tokens, ctx.top_k = tokens.size(0), indices.size(1) if indices.dim() == 2 else 1


def _token_permute_backward(ctx, grad, _grad_sorted_indices):
    # Each token was copied to top_k rows: its gradient is their sum, an unpermute with unit weights.
    (sorted_indices,) = ctx.saved_tensors
    ones = grad.new_ones((ctx.tokens, ctx.top_k)) if ctx.top_k > 1 else None
    return ops.moe_token_unpermute(grad.contiguous(), sorted_indices, ones), None


def _token_unpermute_setup(ctx, inputs, output):
    permuted, sorted_indices, probs = inputs
    ctx.save_for_backward(permuted, sorted_indices, probs)
    ctx.has_probs = probs is not None


def _token_unpermute_backward(ctx, grad):
    permuted, sorted_indices, probs = ctx.saved_tensors
    rows = sorted_indices.long()
    top_k = probs.size(1) if ctx.has_probs else 1
    per_slot = grad.unsqueeze(1).expand(-1, top_k, -1)
    if ctx.has_probs:
        per_slot = per_slot * probs.unsqueeze(-1).to(grad.dtype)
    grad_permuted = grad.new_empty(permuted.shape).index_copy_(0, rows, per_slot.reshape(-1, grad.size(1)))
    grad_probs = None
    if ctx.has_probs and ctx.needs_input_grad[2]:
        per_slot_rows = permuted.index_select(0, rows).view(grad.size(0), top_k, -1)
        grad_probs = (per_slot_rows * grad.unsqueeze(1)).sum(-1).to(probs.dtype)
    return grad_permuted, None, grad_probs


def _grouped_mm_setup(ctx, inputs, output):
    x, counts, weight = inputs
    ctx.save_for_backward(x, counts, weight)


def _grouped_mm_backward(ctx, grad):
    x, counts, weight = ctx.saved_tensors
    grad = grad.contiguous()
    grad_x = ops.grouped_mm_grad_input(grad, counts, weight) if ctx.needs_input_grad[0] else None
    grad_w = ops.grouped_mm_grad_weight(grad, x, counts) if ctx.needs_input_grad[2] else None
    return grad_x, None, grad_w


torch.library.register_autograd("fsdpturbo::moe_permute", _permute_backward, setup_context=_permute_setup)
torch.library.register_autograd("fsdpturbo::moe_unpermute", _unpermute_backward, setup_context=_unpermute_setup)
torch.library.register_autograd("fsdpturbo::grouped_mm", _grouped_mm_backward, setup_context=_grouped_mm_setup)
torch.library.register_autograd("fsdpturbo::moe_token_permute", _token_permute_backward,
                                setup_context=_token_permute_setup)
torch.library.register_autograd("fsdpturbo::moe_token_unpermute", _token_unpermute_backward,
                                setup_context=_token_unpermute_setup)


@torch.library.register_fake("fsdpturbo::moe_token_permute")
def _moe_token_permute_fake(tokens, indices):
    rows = tokens.size(0) * (indices.size(1) if indices.dim() == 2 else 1)
    return tokens.new_empty((rows, tokens.size(1))), tokens.new_empty((rows,), dtype=torch.int32)


@torch.library.register_fake("fsdpturbo::moe_token_unpermute")
def _moe_token_unpermute_fake(permuted, sorted_indices, probs):
    top_k = probs.size(1) if probs is not None else 1
    return permuted.new_empty((sorted_indices.numel() // top_k, permuted.size(1)))


@torch.library.register_fake("fsdpturbo::moe_route")
def _moe_route_fake(expert_ids, num_experts, ep_size):
    new = expert_ids.new_empty
    return (new((num_experts,), dtype=torch.int64), new((expert_ids.numel(),), dtype=torch.int64),
            new((ep_size,), dtype=torch.int64))


@torch.library.register_fake("fsdpturbo::moe_permute")
def _moe_permute_fake(hidden, rows, row_divisor):
    return hidden.new_empty((rows.numel(), hidden.size(1)))


@torch.library.register_fake("fsdpturbo::moe_unpermute")
def _moe_unpermute_fake(permuted, permutation, probs, tokens, top_k):
    return permuted.new_empty((tokens, permuted.size(1)))


@torch.library.register_fake("fsdpturbo::grouped_mm")
def _grouped_mm_fake(x, counts, weight):
    return x.new_empty((x.size(0), weight.size(1)))


@torch.library.register_fake("fsdpturbo::grouped_mm_grad_input")
def _grouped_mm_grad_input_fake(grad_y, counts, weight):
    return grad_y.new_empty((grad_y.size(0), weight.size(2)))


@torch.library.register_fake("fsdpturbo::grouped_mm_grad_weight")
def _grouped_mm_grad_weight_fake(grad_y, x, counts):
    return x.new_empty((counts.size(0), grad_y.size(1), x.size(1)))


@torch.library.register_fake("fsdpturbo::moe_receive")
def _moe_receive_fake(gathered_counts, rank):
    ep_size, num_experts = gathered_counts.shape
    rows = torch.library.get_ctx().new_dynamic_size()
    new = gathered_counts.new_empty
    return (new((num_experts // ep_size,), dtype=torch.int64), new((ep_size,), dtype=torch.int64),
            new((rows,), dtype=torch.int64))
