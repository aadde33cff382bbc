"""Autograd and fake (meta) registrations of the MoE ops of the op library: routing,
permute/unpermute (by rows, and the seed's token contract by expert ids), the experts'
grouped matmul and the MC2 operators (all-to-all-v fused with a grouped matmul)
(`torch.ops.fsdpturbo.*`). `register()` installs them once; fsdpturbo's `__init__` calls it
right after loading the op library (fsdpturbo._native)."""
import torch

from .._native import ops


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
        # Row r of `permuted` is slot permutation[r]: its weight's gradient is the row's dot
        # product with its token's gradient (row r of the gathered gradient), scattered back.
        grad_probs = torch.zeros(probs.numel(), dtype=probs.dtype, device=probs.device)
        grad_probs[permutation] = (permuted * grad_permuted).sum(-1).to(probs.dtype)
        grad_probs = grad_probs.view_as(probs)
        slot_weight = probs.reshape(-1).index_select(0, permutation).to(grad.dtype)
        grad_permuted = grad_permuted * slot_weight.unsqueeze(-1)
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
        per_slot_rows = permuted.index_select(0, rows).view(grad.size(0), top_k, permuted.size(-1))
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


# The MC2 operators (fsdpturbo.moe.dispatch.mc2): the data gradient of each is the mirrored fused
# operator with the counts swapped and the weight untransposed; the weight gradient a grouped
# matmul split along K with the per-local-expert totals.

def _per_local_expert(counts, local, device):
    """Rows per local expert: the P chunks of L counts summed (the seed's column sums)."""
    totals = [sum(counts[j::local]) for j in range(local)]
    return torch.tensor(totals, dtype=torch.int64, device=device)


def _alltoallv_gmm_setup(ctx, inputs, output):
    x, weight, ctx.group, ctx.ep_size, ctx.send, ctx.recv, ctx.trans = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(weight, output[1])


def _alltoallv_gmm_backward(ctx, grad_y, _grad_permuted):
    weight, permuted = ctx.saved_tensors
    grad_y = grad_y.contiguous()
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_x = ops.grouped_mm_alltoallv(grad_y, weight, ctx.group, ctx.ep_size, ctx.recv, ctx.send, not ctx.trans)
    if ctx.needs_input_grad[1]:
        per_expert = _per_local_expert(ctx.recv, weight.size(0), grad_y.device)
        grad_w = ops.grouped_mm_grad_weight(grad_y, permuted, per_expert)
        grad_w = grad_w if ctx.trans else grad_w.transpose(1, 2).contiguous()
    return grad_x, grad_w, None, None, None, None, None


def _gmm_alltoallv_setup(ctx, inputs, output):
    x, weight, ctx.group, ctx.ep_size, ctx.send, ctx.recv, ctx.trans = inputs
    ctx.save_for_backward(x, weight)


def _gmm_alltoallv_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x, grad_rows = ops.alltoallv_grouped_mm(grad.contiguous(), weight, ctx.group, ctx.ep_size, ctx.recv, ctx.send,
                                                 not ctx.trans)
    grad_w = None
    if ctx.needs_input_grad[1]:
        grad_w = ops.grouped_mm_grad_weight(grad_rows, x, _per_local_expert(ctx.send, weight.size(0), x.device))
        grad_w = grad_w if ctx.trans else grad_w.transpose(1, 2).contiguous()
    return grad_x, grad_w, None, None, None, None, None


def _moe_token_permute_fake(tokens, indices):
    rows = tokens.size(0) * (indices.size(1) if indices.dim() == 2 else 1)
    return tokens.new_empty((rows, tokens.size(1))), tokens.new_empty((rows,), dtype=torch.int32)


def _moe_token_unpermute_fake(permuted, sorted_indices, probs):
    top_k = probs.size(1) if probs is not None else 1
    return permuted.new_empty((sorted_indices.numel() // top_k, permuted.size(1)))


def _moe_route_fake(expert_ids, num_experts, ep_size):
    new = expert_ids.new_empty
    return (new((num_experts,), dtype=torch.int64), new((expert_ids.numel(),), dtype=torch.int64),
            new((ep_size,), dtype=torch.int64))


def _moe_permute_fake(hidden, rows, row_divisor):
    return hidden.new_empty((rows.numel(), hidden.size(1)))


def _moe_unpermute_fake(permuted, permutation, probs, tokens, top_k):
    return permuted.new_empty((tokens, permuted.size(1)))


def _grouped_mm_fake(x, counts, weight):
    return x.new_empty((x.size(0), weight.size(1)))


def _grouped_mm_grad_input_fake(grad_y, counts, weight):
    return grad_y.new_empty((grad_y.size(0), weight.size(2)))


def _grouped_mm_grad_weight_fake(grad_y, x, counts):
    return x.new_empty((counts.size(0), grad_y.size(1), x.size(1)))


def _out_features(weight, trans_weight):
    return weight.size(1) if trans_weight else weight.size(2)


def _alltoallv_gmm_fake(x, weight, group, ep_world_size, send_counts, recv_counts, trans_weight):
    rows = sum(recv_counts)
    return x.new_empty((rows, _out_features(weight, trans_weight))), x.new_empty((rows, x.size(1)))


def _gmm_alltoallv_fake(x, weight, group, ep_world_size, send_counts, recv_counts, trans_weight):
    return x.new_empty((sum(recv_counts), _out_features(weight, trans_weight)))


_AUTOGRAD = {
    "fsdpturbo::moe_permute": (_permute_backward, _permute_setup),
    "fsdpturbo::moe_unpermute": (_unpermute_backward, _unpermute_setup),
    "fsdpturbo::grouped_mm": (_grouped_mm_backward, _grouped_mm_setup),
    "fsdpturbo::moe_token_permute": (_token_permute_backward, _token_permute_setup),
    "fsdpturbo::moe_token_unpermute": (_token_unpermute_backward, _token_unpermute_setup),
    "fsdpturbo::alltoallv_grouped_mm": (_alltoallv_gmm_backward, _alltoallv_gmm_setup),
    "fsdpturbo::grouped_mm_alltoallv": (_gmm_alltoallv_backward, _gmm_alltoallv_setup),
}

_FAKES = {
    "fsdpturbo::moe_token_permute": _moe_token_permute_fake,
    "fsdpturbo::moe_token_unpermute": _moe_token_unpermute_fake,
    "fsdpturbo::moe_route": _moe_route_fake,
    "fsdpturbo::moe_permute": _moe_permute_fake,
    "fsdpturbo::moe_unpermute": _moe_unpermute_fake,
    "fsdpturbo::grouped_mm": _grouped_mm_fake,
    "fsdpturbo::grouped_mm_grad_input": _grouped_mm_grad_input_fake,
    "fsdpturbo::grouped_mm_grad_weight": _grouped_mm_grad_weight_fake,
    "fsdpturbo::alltoallv_grouped_mm": _alltoallv_gmm_fake,
    "fsdpturbo::grouped_mm_alltoallv": _gmm_alltoallv_fake,
}

_registered = False


def register():
    """Registers the autograd formulas and fake (meta) kernels of the op library's MoE ops
    (once; later calls do nothing)."""
    global _registered
    if _registered:
        return
    for op, (backward, setup) in _AUTOGRAD.items():
        torch.library.register_autograd(op, backward, setup_context=setup)
    for op, fake in _FAKES.items():
        torch.library.register_fake(op, fake)
    _registered = True
