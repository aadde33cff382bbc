"""The collectives of Ulysses context parallelism over one process group: a rank's chunk of a
sequence, the whole sequence gathered from the chunks, and the all-to-all between the
sequence-sharded and the head-sharded layouts. Each differentiates as what it computes."""
import torch
import torch.distributed as dist


def chunk(tensor, group, dim=-1):
    """This rank's contiguous chunk of `tensor` along `dim` (the sequence)."""
    return tensor.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)].contiguous()


def gather(tensor, group, dim=-1):
    """The chunks of `group`'s ranks concatenated along `dim` in rank order (not differentiable:
    for ids, labels and masks)."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class _GatherSequence(torch.autograd.Function):
    """`gather`, whose backward sums the gradient over the group and keeps this rank's chunk
    (gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return chunk(grad, ctx.group, ctx.dim), None, None


def gather_sequence(x, group, dim=1):
    """The whole sequence from this rank's chunk `x`, differentiable: every rank that uses the
    result sends its gradient back to the chunk's owner."""
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


def all_to_all(x, group, split_dim, concat_dim):
    """Ulysses' layout switch: `x` split over the group along `split_dim` and gathered along
    `concat_dim` (heads → sequence: split the heads, concatenate the sequence; and back)."""
    return _AllToAll.apply(x, group, split_dim, concat_dim)
