"""`full_attention`: an eager attention function (Hugging Face's `eager_attention_forward(module,
query, key, value, attention_mask, **kwargs) -> (output [B, S, H, D], weights)`) made to work
on sequence chunks. Query, key and value come in [B, heads, S/cp, D] for this rank's chunk;
an all-to-all gives each rank H/cp heads over the whole sequence, the original attends there,
and a second all-to-all brings the output back to the chunk's tokens and all heads.

Key/value heads: when cp divides their number they are split like the query heads; otherwise
(ulysses > kv heads) each is repeated the fewest times that makes them split, and the original
sees the module with as many fewer key/value groups.

The mask: None stays None; a mask of the whole sequence ([B, 1 or H, S, S], built after the
sequence was split, as a post-fusion model forward does) is used as it is. A mask of the
chunk's length is what the model built from its chunk alone: it cannot say which earlier
chunks a token sees, so the causal mask of the whole sequence replaces it — with the packed
sequences that the gathered `position_ids` mark (a position that does not follow its
predecessor starts a sequence, as Hugging Face reads them) and the layer's sliding window. The
chunk's own mask must be this mask's diagonal block; a padded batch's is not, and is refused
rather than attended wrongly. That check reads the mask (one device sync per layer).
"""
import functools

import torch
import torch.distributed as dist

from .model import group_of
from .sequence import all_to_all, gather

__all__ = ["full_attention"]


class _FewerKeyValueGroups:
    """`module` as the attention function sees it after its key/value heads were repeated:
    each now serves `num_key_value_groups` query heads."""

    def __init__(self, module, num_key_value_groups):
        self._module = module
        self.num_key_value_groups = num_key_value_groups

    def __getattr__(self, name):
        return getattr(self._module, name)


def _key_value_repeat(heads, kv_heads, cp):
    """The fewest repeats of each key/value head that make their number divisible by cp while
    each still serves whole query heads."""
    groups = heads // kv_heads
    return next(r for r in range(1, groups + 1) if groups % r == 0 and kv_heads * r % cp == 0)


def _visible(mask):
    return mask if mask.dtype == torch.bool else mask == 0


def _whole_sequence_mask(local_mask, group, kwargs):
    """The mask of the whole sequence for a `local_mask` built from this rank's chunk alone (see
    the module docstring); ValueError when the chunk's mask is not its diagonal block."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    batch, local_len = local_mask.shape[0], local_mask.shape[-1]
    index = torch.arange(local_len * cp, device=local_mask.device)
    offset = index[:, None] - index[None, :]  # query - key
    visible = offset >= 0
    window = kwargs.get("sliding_window")
    if window:
        visible = visible & (offset < window)
    visible = visible.expand(batch, -1, -1)
    positions = kwargs.get("position_ids")
    if positions is not None and positions.dim() == 2:
        positions = gather(positions, group, dim=-1)
        starts = positions.diff(dim=-1, prepend=positions[:, :1] - 1) != 1
        sequence = starts.cumsum(-1)
        visible = visible & (sequence[:, :, None] == sequence[:, None, :])
    visible = visible[:, None]
    chunk = slice(rank * local_len, (rank + 1) * local_len)
    block = visible[..., chunk, chunk]
    if not torch.equal(_visible(local_mask), block.expand_as(local_mask)):
        raise ValueError(
            f"fsdpturbo Ulysses full_attention: the attention mask of this rank's chunk (shape "
            f"{tuple(local_mask.shape)}) is not causal over the (packed) sequences its position_ids mark, so the "
            f"whole sequence's mask cannot be rebuilt from it (a padded batch?); accepted: no padding (pack the "
            f"sequences and pass position_ids), or a 4-D mask of the whole sequence")
    if local_mask.dtype == torch.bool:
        return visible
    return torch.zeros(visible.shape, dtype=local_mask.dtype, device=local_mask.device).masked_fill(
        ~visible, torch.finfo(local_mask.dtype).min)


def _mask_for_heads(mask, group, local_len, heads):
    """The mask the original attends with over the whole sequence and this rank's heads."""
    if mask is None:
        return None
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    full_len = local_len * cp
    if tuple(mask.shape[-2:]) not in ((full_len, full_len), (local_len, local_len)):
        raise ValueError(f"fsdpturbo Ulysses full_attention: an attention mask of shape {tuple(mask.shape)} fits "
                         f"neither the chunk ({local_len} tokens) nor the whole sequence ({full_len}); accepted: None, "
                         f"[B, 1 or heads, {local_len}, {local_len}] or [B, 1 or heads, {full_len}, {full_len}]")
    if mask.shape[1] > 1:
        local_heads = heads // cp
        mask = mask[:, rank * local_heads:(rank + 1) * local_heads]
    return mask


def full_attention(original):
    """`original` (an eager attention function) for the modules of attached models: see the
    module docstring. Other modules call `original` unchanged."""

    @functools.wraps(original)
    def ulysses_attention(module, query, key, value, attention_mask, *args, **kwargs):
        group = group_of(module)
        if group is None:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        cp = dist.get_world_size(group)
        heads, kv_heads, local_len = query.shape[1], key.shape[1], query.shape[2]
        if heads % cp:
            raise ValueError(f"fsdpturbo Ulysses full_attention: {heads} attention heads do not split over a Ulysses "
                             f"group of {cp} ranks; accepted: a ulysses_parallel_size that divides {heads}")
        repeat = _key_value_repeat(heads, kv_heads, cp)
        if repeat > 1:
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
            module = _FewerKeyValueGroups(module, heads // kv_heads // repeat)
        if attention_mask is not None and attention_mask.shape[-2:] == (local_len, local_len):
            attention_mask = _whole_sequence_mask(attention_mask, group, kwargs)
        attention_mask = _mask_for_heads(attention_mask, group, local_len, heads)
        query, key, value = (all_to_all(t, group, split_dim=1, concat_dim=2) for t in (query, key, value))
        output, _ = original(module, query, key, value, attention_mask, *args, **kwargs)
        expected = (query.shape[0], local_len * cp, heads // cp)
        if tuple(output.shape[:3]) != expected:
            raise ValueError(f"fsdpturbo Ulysses full_attention: {original.__module__}.{original.__name__} returned "
                             f"{tuple(output.shape)}; accepted: Hugging Face's layout [batch, sequence, heads, head_dim] "
                             f"= [{', '.join(map(str, expected))}, ...]")
        return all_to_all(output, group, split_dim=1, concat_dim=2), None

    return ulysses_attention
