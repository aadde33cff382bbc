"""`causal_lm_loss`: Hugging Face's causal-LM loss (`ForCausalLMLoss(logits, labels, vocab_size,
num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs)`) on sequence chunks.

`logits` and `labels` are this rank's chunk of each sequence. Unshifted `labels` are gathered
over the Ulysses group, shifted over the whole sequence (the last token of a chunk predicts the
first of the next chunk's) and chunked again; `shift_labels` (already shifted over the whole
sequence, then chunked) are used as they are. The loss is the mean over the tokens of all
chunks — `num_items_in_batch` when given (it must then count the whole sequences' tokens) — and
is the same on every rank of the group: the chunks' sums are gathered, and the gather's
backward sends each chunk the gradient of every rank's loss, so each rank's gradient is the
group size times its chunk's share, as `fsdpturbo.efsdp`'s reduction rule expects.
"""
import functools

import torch
import torch.nn.functional as F

from .sequence import chunk, gather, gather_sequence

__all__ = ["causal_lm_loss"]


def _shifted_chunk(labels, group, ignore_index):
    """This rank's chunk of the whole sequences' next-token targets."""
    whole = gather(labels, group, dim=-1)
    return chunk(F.pad(whole[..., 1:], (0, 1), value=ignore_index), group, dim=-1)


def causal_lm_loss(original, group):
    """`original` (Hugging Face's causal-LM loss) for a model whose sequences are split over
    `group` (more than one rank): see the module docstring."""

    @functools.wraps(original)
    def ulysses_causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                               shift_labels=None, **kwargs):
        if shift_labels is None:
            shift_labels = _shifted_chunk(labels, group, ignore_index)
        shift_labels = shift_labels.to(logits.device)
        numerator = F.cross_entropy(logits.float().reshape(-1, vocab_size), shift_labels.reshape(-1),
                                    ignore_index=ignore_index, reduction="sum")
        total = gather_sequence(numerator.reshape(1), group, dim=0).sum()
        if num_items_in_batch is None:
            count = (shift_labels != ignore_index).sum().reshape(1)
            num_items_in_batch = gather(count, group, dim=0).sum()
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch

    return ulysses_causal_lm_loss
