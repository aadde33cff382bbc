"""The CPU stand-in for `flash_attn` that LlamaFactory's context parallelism runs on in these
tests (tests/llamafactory/site/flash_attn, accepted by transformers through the sitecustomize
beside it), called the way transformers 5.8 calls FlashAttention 2 (`_flash_attention_forward`),
against torch's `scaled_dot_product_attention` on the padded batch with an explicit mask and
against attention written out in float64, element by element, in float32 and float64: causal and not, grouped-query heads, a right-padded batch
(attention_mask: unpad, varlen, pad), packed sequences of different lengths (position_ids) and
a causal query shorter than its keys (aligned bottom-right).

Bound: each is attention computed in the dtype under test, in its own order, so within the
first-order rounding bound of its weighted sum over the Sk keys, Sk · u · Σ_j p_j |v_j| (u the
dtype's unit roundoff, p the probabilities in float64), of the exact result; two of them differ
by at most twice that, and 4 × covers the roundings of the scores, exponentials and
normalisation. (Measured: the stand-in equals SDPA exactly in every case here.)"""
import pytest
import torch
import torch.nn.functional as F

DTYPES = [torch.float32, torch.float64]
HEADS, KV_HEADS, DIM = 4, 2, 8


def _qkv(batch, sq, sk, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, sq, HEADS, DIM, generator=g, dtype=torch.float64)
    k = torch.randn(batch, sk, KV_HEADS, DIM, generator=g, dtype=torch.float64)
    v = torch.randn(batch, sk, KV_HEADS, DIM, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _sdpa(q, k, v, mask):
    """SDPA on [B, S, H, D] tensors with a boolean mask [B, Sq, Sk] (True: attend)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None], enable_gqa=True)
    return out.transpose(1, 2)


def _eager64(q, k, v, mask):
    """Attention written out in float64: the output and, per element, the bound of the module
    docstring, 4 · 2 · Sk · u · Σ_j p_j |v_j|."""
    q64, k64, v64 = (t.double().transpose(1, 2) for t in (q, k, v))
    k64, v64 = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k64, v64))
    scores = (q64 @ k64.transpose(-1, -2)) * DIM ** -0.5
    p = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
    unit_roundoff = torch.finfo(q.dtype).eps / 2
    bound = 4 * 2 * k.shape[1] * unit_roundoff * (p @ v64.abs())
    return (p @ v64).transpose(1, 2), bound.transpose(1, 2)


def _check(ours, q, k, v, mask, rows, what):
    """`ours` (rows `rows`) against SDPA on the padded batch and against float64 attention."""
    eager, bound = _eager64(q, k, v, mask)
    for name, ref in (("SDPA", _sdpa(q, k, v, mask)), ("float64", eager)):
        excess = ((ours.double() - ref.double()).abs() - bound)[rows]
        assert excess.max().item() <= 0, f"{what} vs {name}: {excess.max().item():.3g} over the bound"


def _flash(q, k, v, **kwargs):
    from transformers.modeling_flash_attention_utils import _flash_attention_forward

    return _flash_attention_forward(q, k, v, query_length=q.shape[1], attn_implementation="flash_attention_2",
                                    **kwargs)


def test_transformers_takes_the_stand_in():
    import flash_attn
    from transformers.modeling_flash_attention_utils import lazy_import_flash_attention
    from transformers.utils import is_flash_attn_2_available

    assert is_flash_attn_2_available()
    (flash_fn, varlen_fn, _, pad_fn, unpad_fn), _ = lazy_import_flash_attention("flash_attention_2")
    assert (flash_fn, varlen_fn) == (flash_attn.flash_attn_func, flash_attn.flash_attn_varlen_func)
    assert (pad_fn, unpad_fn) == (flash_attn.bert_padding.pad_input, flash_attn.bert_padding.unpad_input)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
def test_batch(dtype, causal):
    q, k, v = _qkv(2, 7, 7, dtype)
    mask = torch.ones(2, 7, 7, dtype=torch.bool)
    if causal:
        mask = mask.tril()
    ours = _flash(q, k, v, attention_mask=None, is_causal=causal)
    _check(ours, q, k, v, mask, slice(None), f"{dtype} causal={causal}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_batch(dtype):
    """Right padding: the valid rows equal SDPA restricted to each sequence's tokens; padded
    rows are exactly zero, as FlashAttention's pad_input leaves them."""
    lengths = torch.tensor([7, 4, 1])
    q, k, v = _qkv(3, 7, 7, dtype, seed=1)
    valid = torch.arange(7)[None] < lengths[:, None]
    mask = torch.ones(7, 7, dtype=torch.bool).tril()[None] & valid[:, None, :]
    mask |= ~valid[:, :, None]  # padded query rows attend anywhere (ignored), keeping SDPA finite
    ours = _flash(q, k, v, attention_mask=valid.long(), is_causal=True)
    _check(ours, q, k, v, mask, valid, f"{dtype} padded")
    assert torch.count_nonzero(ours[~valid]) == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_variable_length_sequences(dtype):
    """Sequences of 3, 5 and 2 tokens packed into one row, told apart by their position ids:
    each attends causally within itself only."""
    lengths = [3, 5, 2]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    sequence = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    q, k, v = _qkv(1, sum(lengths), sum(lengths), dtype, seed=2)
    mask = (torch.ones(10, 10, dtype=torch.bool).tril() & (sequence[:, None] == sequence[None]))[None]
    ours = _flash(q, k, v, attention_mask=None, is_causal=True, position_ids=position_ids)
    _check(ours, q, k, v, mask, slice(None), f"{dtype} packed")


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_query_shorter_than_keys_is_aligned_bottom_right(dtype):
    from flash_attn import flash_attn_func

    q, k, v = _qkv(2, 3, 7, dtype, seed=3)
    mask = torch.ones(3, 7, dtype=torch.bool).tril(4)[None].expand(2, -1, -1)
    ours = flash_attn_func(q, k, v, causal=True)
    _check(ours, q, k, v, mask, slice(None), f"{dtype} bottom-right")


def test_what_training_does_not_use_raises():
    from flash_attn import flash_attn_func

    q, k, v = _qkv(1, 4, 4, torch.float32)
    for kwargs in ({"dropout_p": 0.1}, {"window_size": (2, 0)}, {"softcap": 30.0}, {"return_attn_probs": True}):
        with pytest.raises(NotImplementedError):
            flash_attn_func(q, k, v, **kwargs)
