"""`gated_delta_net`: a head-parallel forward for Qwen3.5's (and Qwen3-Next's) linear attention,
Hugging Face's `*GatedDeltaNet` (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, a depthwise
causal conv1d, A_log, dt_bias, a gated RMSNorm, out_proj).

On this rank's chunk of the sequence: the input projections. Then q, k, v, b and a go to the
head-sharded layout (the whole sequence, heads / cp of each kind) with all-to-alls; the short
convolution runs over the whole sequence with this rank's channels of `conv1d.weight` (it is
depthwise, so a channel slice is exact), the decay takes this rank's heads of `A_log` and
`dt_bias`, and the gated delta rule recurs over the whole sequence with the module's own
kernel (a kernel plugin's, or Hugging Face's torch one). The output goes back to the chunk
and all heads, through the gated RMSNorm (with the chunk's z) and out_proj. Needs cp to
divide both the key and the value heads.

For training: a cache is accepted as Hugging Face passes one, but the linear attention's
states are not recorded into it (no rank holds them whole); a cache that already holds state
(decoding) is refused. Packed sequences given as `cu_seq_lens_q` are refused too.
"""
import functools
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .model import group_of
from .sequence import all_to_all

__all__ = ["gated_delta_net"]

# A kernel, as an attribute of the module (Hugging Face up to 5.8, or set by a kernel plugin)
# or else a function of the module's modeling file (later versions).
_CONV_KERNELS = ("causal_conv1d_fn",)
_RECURRENCE_KERNELS = ("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule")


def _module_function(module, names):
    for name in names:
        kernel = getattr(module, name, None)
        if kernel is not None:
            return kernel
    namespace = vars(sys.modules[type(module).__module__])
    return next((namespace[name] for name in names if namespace.get(name) is not None), None)


def _depthwise_causal_conv(module, x, weight, bias):
    """The module's causal conv1d (with its activation) of `x` [B, channels, S] by `weight`
    [channels, kernel]."""
    kernel = _module_function(module, _CONV_KERNELS)
    if kernel is not None:
        return kernel(x, weight, bias, activation=module.activation)
    from transformers.activations import ACT2FN

    out = F.conv1d(x.to(weight.dtype), weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1,
                   groups=x.shape[1])[..., :x.shape[-1]]
    return ACT2FN[module.activation](out).to(x.dtype)


def _has_state(cache, layer_idx):
    """Whether `cache` holds this layer's linear-attention state already (Hugging Face 5.8:
    `has_previous_state(layer)`; later versions: a recurrent state that is not None)."""
    if cache is None:
        return False
    if callable(getattr(cache, "has_previous_state", None)):
        return cache.has_previous_state(layer_idx)
    return cache.get_recurrent_state(layer_idx, state_idx=0) is not None


def _to_heads(group, *tensors):
    """[B, S/cp, heads, d] tensors (concatenated along d for one exchange) → [B, S, heads/cp, d] each."""
    widths = [t.shape[-1] for t in tensors]
    exchanged = all_to_all(torch.cat(tensors, dim=-1), group, split_dim=2, concat_dim=1)
    return exchanged.split(widths, dim=-1)


def _head_parallel_forward(self, hidden_states, group, attention_mask, cache, kwargs):
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    if self.num_k_heads % cp or self.num_v_heads % cp:
        raise ValueError(f"fsdpturbo Ulysses gated_delta_net: {self.num_k_heads} key and {self.num_v_heads} value heads "
                         f"do not both split over a Ulysses group of {cp} ranks; accepted: a ulysses_parallel_size "
                         f"that divides both")
    if _has_state(cache, self.layer_idx):
        raise ValueError("fsdpturbo Ulysses gated_delta_net: the cache holds linear-attention state (decoding), which "
                         "context parallelism does not keep; accepted: training and prefill forwards")
    if kwargs.get("cu_seq_lens_q") is not None:
        raise ValueError("fsdpturbo Ulysses gated_delta_net: packed sequences given as cu_seq_lens_q are not split "
                         "over the Ulysses group; accepted: one sequence per row")
    modeling = vars(sys.modules[type(self).__module__])
    hidden_states = modeling["apply_mask_to_padding_states"](hidden_states, attention_mask)
    batch, local_len, _ = hidden_states.shape
    k_heads, v_heads = self.num_k_heads // cp, self.num_v_heads // cp

    q, k, v = self.in_proj_qkv(hidden_states).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
    z = self.in_proj_z(hidden_states).reshape(batch, local_len, -1, self.head_v_dim)
    b, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)
    q, k = _to_heads(group, q.reshape(batch, local_len, -1, self.head_k_dim),
                     k.reshape(batch, local_len, -1, self.head_k_dim))
    (v,) = _to_heads(group, v.reshape(batch, local_len, -1, self.head_v_dim))
    b, a = (t.squeeze(-1) for t in _to_heads(group, b.unsqueeze(-1), a.unsqueeze(-1)))

    keys = slice(rank * k_heads * self.head_k_dim, (rank + 1) * k_heads * self.head_k_dim)
    values = slice(rank * v_heads * self.head_v_dim, (rank + 1) * v_heads * self.head_v_dim)
    channels = [keys, slice(keys.start + self.key_dim, keys.stop + self.key_dim),
                slice(values.start + 2 * self.key_dim, values.stop + 2 * self.key_dim)]
    weight = torch.cat([self.conv1d.weight.squeeze(1)[c] for c in channels])
    bias = None if self.conv1d.bias is None else torch.cat([self.conv1d.bias[c] for c in channels])
    mixed = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1).transpose(1, 2)
    mixed = _depthwise_causal_conv(self, mixed, weight, bias).transpose(1, 2)
    q, k, v = mixed.split([k_heads * self.head_k_dim, k_heads * self.head_k_dim, v_heads * self.head_v_dim], dim=-1)
    full_len = local_len * cp
    q, k = (t.reshape(batch, full_len, k_heads, self.head_k_dim) for t in (q, k))
    v = v.reshape(batch, full_len, v_heads, self.head_v_dim)
    if v_heads > k_heads:  # each key head serves consecutive value heads
        q, k = (t.repeat_interleave(v_heads // k_heads, dim=2) for t in (q, k))

    heads = slice(rank * v_heads, (rank + 1) * v_heads)
    beta = b.sigmoid()
    g = -self.A_log[heads].float().exp() * F.softplus(a.float() + self.dt_bias[heads])
    recurrence = _module_function(self, _RECURRENCE_KERNELS)
    out, _ = recurrence(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=True)

    out = all_to_all(out, group, split_dim=1, concat_dim=2)  # [B, S/cp, heads, d]
    out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(out.reshape(batch, local_len, -1))


def gated_delta_net(original):
    """A `*GatedDeltaNet.forward` that is head-parallel for the modules of attached models (see
    the module docstring); other modules run `original`."""

    @functools.wraps(original)
    def forward(self, hidden_states, cache=None, attention_mask=None, *, cache_params=None, **kwargs):
        group = group_of(self)
        if group is None:
            if cache_params is not None:
                kwargs["cache_params"] = cache_params
            elif cache is not None:
                kwargs["cache"] = cache
            return original(self, hidden_states, attention_mask=attention_mask, **kwargs)
        return _head_parallel_forward(self, hidden_states, group, attention_mask,
                                      cache if cache is not None else cache_params, kwargs)

    return forward
