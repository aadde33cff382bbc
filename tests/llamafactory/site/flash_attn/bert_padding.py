"""`flash_attn.bert_padding` of the CPU stand-in: moving between a padded batch [B, S, ...]
and its valid tokens packed into [total, ...] (FlashAttention 2.8's signatures)."""
import torch
import torch.nn.functional as F


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """The tokens where `attention_mask` (or `unused_mask`) is set, in row-major order. Returns
    (tokens [total, ...], their flat indices, cu_seqlens int32 [B + 1], the longest sequence
    (int), the number of tokens of each sequence `attention_mask` selects int32 [B])."""
    selected = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens = selected.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(selected.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    tokens = hidden_states.reshape(-1, *hidden_states.shape[2:])[indices]
    return tokens, indices, cu_seqlens, int(seqlens.max()), attention_mask.sum(dim=-1, dtype=torch.int32)


def pad_input(hidden_states, indices, batch, seqlen):
    """The inverse of `unpad_input`: tokens [total, ...] back to [batch, seqlen, ...], zeros elsewhere."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.view(batch, seqlen, *hidden_states.shape[1:])
