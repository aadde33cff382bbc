"""Ulysses context parallelism at test level, to drive our engine the way LlamaFactory's and
verl's CP drive it: each rank of a CP group holds one contiguous chunk of every sequence; full
attention switches to head-sharded layout over the whole sequence and back with two all-to-alls
(the rank's heads for every token); Qwen3.5's linear attention (a short convolution and a
recurrence over the whole sequence) runs on the sequence gathered over the group, each rank
keeping its chunk; the loss is the whole sequence's on every CP rank (numerators gathered, as
LlamaFactory's `sequence_parallel_loss` does), so its backward reaches each rank's chunk once
per CP rank and every rank's gradient is cp × its chunk's share: summed over the world and
divided by the world size it is the gradient of the mean over the data-parallel ranks' losses.
The package's own Ulysses (head-parallel linear attention too) is issue 24's part 4."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

ATTENTION = "fsdpturbo_test_ulysses"
IGNORE_INDEX = -100


def chunk(tensor, group, dim=-1):
    """This rank's contiguous chunk of `tensor` along `dim` (the sequence)."""
    return tensor.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)].contiguous()


class _GatherSequence(torch.autograd.Function):
    """All-gather along `dim` over `group`; the backward sums the gradient over the group and
    keeps this rank's chunk (gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return chunk(grad, ctx.group, ctx.dim), None, None


def gather_sequence(x, group, dim=1):
    return _GatherSequence.apply(x, group, dim)


def _exchange(x, group, split_dim, concat_dim):
    """Sends the i-th chunk of `x` along `split_dim` to rank i of `group` and concatenates what
    arrives, in rank order, along `concat_dim`."""
    send = torch.stack(x.chunk(dist.get_world_size(group), dim=split_dim)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=concat_dim)


class _AllToAll(torch.autograd.Function):
    """`_exchange`, whose backward is the exchange back."""

    @staticmethod
    def forward(ctx, x, group, split_dim, concat_dim):
        ctx.group, ctx.split_dim, ctx.concat_dim = group, split_dim, concat_dim
        return _exchange(x, group, split_dim, concat_dim)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group, ctx.concat_dim, ctx.split_dim), None, None, None


def _all_to_all(x, group, split_dim, concat_dim):
    return _AllToAll.apply(x, group, split_dim, concat_dim)


def _attention(group):
    def ulysses_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """query [B, H, S/cp, D], key and value [B, Hkv, S/cp, D] (sequence-sharded) -> the
        causal attention output [B, S/cp, H, D]. Key and value heads are repeated to H first,
        so that any number of them splits over the group."""
        if dropout or attention_mask is not None:
            raise NotImplementedError("the test Ulysses attention is causal, without padding or dropout")
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        q, k, v = (_all_to_all(t, group, split_dim=1, concat_dim=2) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)
        return _all_to_all(out, group, split_dim=2, concat_dim=1).transpose(1, 2), None

    return ulysses_attention


def _gathered_forward(forward, group):
    def linear_attention_on_the_whole_sequence(hidden_states, *args, **kwargs):
        return chunk(forward(gather_sequence(hidden_states, group), *args, **kwargs), group, dim=1)

    return linear_attention_on_the_whole_sequence


def install(model, group):
    """Makes `model` (a Qwen3-MoE or Qwen3.5-MoE causal LM) take sequence chunks on the ranks
    of `group`: its full attention Ulysses, its linear attention on the gathered sequence."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention(group))
    model.set_attn_implementation(ATTENTION)
    for module in model.modules():
        if hasattr(module, "in_proj_qkv"):  # Qwen3.5's gated delta net
            module.forward = _gathered_forward(module.forward, group)
    return model


def shifted_labels(ids):
    """Next-token targets of the whole sequences `ids` [B, S] (the last has none)."""
    return F.pad(ids[:, 1:], (0, 1), value=IGNORE_INDEX)


def causal_lm_loss(logits, labels, group):
    """Mean next-token cross entropy over the whole sequences: `logits` [B, S/cp, V] of this
    rank's chunk, `labels` [B, S] of the whole sequences (`shifted_labels`)."""
    local = chunk(labels, group)
    numerator = F.cross_entropy(logits.float().flatten(0, 1), local.flatten(), ignore_index=IGNORE_INDEX,
                                reduction="sum")
    return gather_sequence(numerator.reshape(1), group, dim=0).sum() / (labels != IGNORE_INDEX).sum()
