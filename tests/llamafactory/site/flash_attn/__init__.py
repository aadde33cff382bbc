"""A CPU stand-in for the `flash_attn` package (FlashAttention 2.8's Python API), for the
LlamaFactory tests only: LlamaFactory's context parallelism requires `flash_attn:
flash_attention_2` and flash-attn has no CPU build. It lives in tests/llamafactory/site,
which only the ctest entry `llamafactory_trainer` puts on PYTHONPATH; the sitecustomize beside
it makes transformers accept it on CPU.

Each call is exact attention by torch's `scaled_dot_product_attention`: `flash_attn_func` on the
batch, `flash_attn_varlen_func` one sequence at a time. A causal mask is aligned bottom-right
when the query is shorter than the keys, as in FlashAttention >= 2.1. What training with
transformers does not use (dropout, sliding windows, softcap, ALiBi, the KV cache, attention
probabilities) raises instead of being ignored.
"""
import torch
import torch.nn.functional as F

__version__ = "2.8.3"


def _check_supported(dropout_p, window_size, softcap, alibi_slopes, return_attn_probs):
    if dropout_p or tuple(window_size) != (-1, -1) or softcap or alibi_slopes is not None or return_attn_probs:
        raise NotImplementedError("the CPU flash_attn stand-in computes plain attention only: dropout_p=0, "
                                  "window_size=(-1, -1), softcap=0, no alibi_slopes, no return_attn_probs")


def _attention(q, k, v, softmax_scale, causal):
    """q [..., Sq, Hq, D], k and v [..., Sk, Hk, D] (Hq a multiple of Hk) -> [..., Sq, Hq, D]."""
    sq, sk = q.shape[-3], k.shape[-3]
    mask = None
    if causal:
        if sq > sk:
            raise NotImplementedError("causal attention with more queries than keys")
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
    out = F.scaled_dot_product_attention(q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2),
                                         attn_mask=mask, scale=softmax_scale, enable_gqa=True)
    return out.transpose(-3, -2)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q [B, Sq, Hq, D], k and v [B, Sk, Hk, D] -> [B, Sq, Hq, D]."""
    _check_supported(dropout_p, window_size, softcap, alibi_slopes, return_attn_probs)
    return _attention(q, k, v, softmax_scale, causal)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """q [total_q, Hq, D], k and v [total_k, Hk, D]; sequence i is rows cu_seqlens[i]:cu_seqlens[i+1]
    of each. Returns [total_q, Hq, D]; rows past cu_seqlens_q[-1] are zero."""
    _check_supported(dropout_p, window_size, softcap, alibi_slopes, return_attn_probs)
    if block_table is not None:
        raise NotImplementedError("the CPU flash_attn stand-in has no paged KV cache")
    out = q.new_zeros(q.shape[:-1] + v.shape[-1:])
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for (q0, q1), (k0, k1) in zip(zip(starts_q, starts_q[1:]), zip(starts_k, starts_k[1:])):
        if q1 > q0:
            out[q0:q1] = _attention(q[q0:q1], k[k0:k1], v[k0:k1], softmax_scale, causal)
    return out


def flash_attn_with_kvcache(*args, **kwargs):
    raise NotImplementedError("the CPU flash_attn stand-in has no KV-cache attention (generation)")
