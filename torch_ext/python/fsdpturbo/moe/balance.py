"""Load-balancing losses over the global batch: the Switch/Qwen aux loss, its sequence-wise
form and the router z-loss, right under data, expert and context parallelism, gradient
accumulation and activation checkpointing.

Hugging Face's Qwen3-MoE and Qwen3.5-MoE causal LMs add `router_aux_loss_coef * aux_loss` to
the loss, where `load_balancing_loss_func` of their modeling module computes, from the router
logits of all MoE layers pooled (L layers × N tokens, rows weighted by the attention mask),
aux = E · Σ_e f_e · P_e: f_e the fraction of top-k slots taken by expert e, P_e its mean router
probability. On a data-parallel rank that is the statistic of the rank's own tokens. `install`
(called by `shard_model`) makes that function, for the sharded model only, compute
`dist_config.aux_loss_scope`:

* `global` (default): f and P over the global batch of this forward (every rank; one
  all-reduce of 2E + 4 floats per forward, no host sync). The value is the one-process value
  on the concatenation of all ranks' batches; each rank backpropagates F × its own share of it
  (F: the engine's gradient divide factor), so after the engine's reduction (gradients summed
  over ranks, divided by F) every gradient is the one-process gradient. f carries no gradient.
* `sequence`: the same loss per sequence (a batch row, over its unmasked tokens), averaged over
  the sequences of the global batch (DeepSeek-V3's sequence-wise balance loss in Hugging
  Face's pooled form: on one sequence it equals Hugging Face's value).
* `local`: Hugging Face's per-rank value, unchanged.

`dist_config.router_z_loss_coef` c > 0 adds ST-MoE's z-loss: c × the mean of
logsumexp(router logits)² over the global batch's tokens and all MoE layers pooled (as Hugging
Face's Switch Transformers pools them), added to `output.loss` and returned as
`output.z_loss` (it needs the router logits: `output_router_logits=True`).

Gradient accumulation: within `balance_step(model, attention_masks)` the normaliser is the
step's: each micro-batch's z-loss and sequence aux loss are divided by the step's global token
(sequence) count, so their sum over the step's micro-batches is exactly the value over the
whole step; the global aux loss of a micro-batch is weighted by its share of the step's tokens.

A forward without grad (evaluation, generation) runs no collective: it returns the per-rank
values, so ranks may run different numbers of such forwards. The losses are computed once per
forward, from the router logits of the first pass, so the forward that activation
checkpointing re-runs in backward counts nothing again.
"""
import contextlib
import contextvars
import dataclasses
import functools
import logging
import sys
import types
from typing import List, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = ["balance_step", "install"]

_MODELING = ("transformers.models.qwen3_moe.modeling_qwen3_moe",
             "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
_RUNNING = contextvars.ContextVar("fsdpturbo_balance_forward", default=None)


@dataclasses.dataclass
class _Step:
    """The normalisers of `balance_step`: the step's global token and sequence counts (float32
    scalars on the device) and the (batch, sequence) shape each micro-batch's forward must have."""
    tokens: torch.Tensor
    sequences: torch.Tensor
    shapes: List[tuple]
    ran: int = 0

    def next_forward(self, shape):
        if self.ran == len(self.shapes):
            raise ValueError(f"fsdpturbo.balance_step: forward {self.ran + 1} of a step declared with "
                             f"{len(self.shapes)} micro-batches; pass every micro-batch's attention mask")
        if shape is not None and tuple(shape) != self.shapes[self.ran]:
            raise ValueError(f"fsdpturbo.balance_step: micro-batch {self.ran} has shape {list(shape)}, its declared "
                             f"attention mask {list(self.shapes[self.ran])}; pass the masks in the order the "
                             f"forwards run")
        self.ran += 1


@dataclasses.dataclass
class Balance:
    """A sharded model's balance-loss settings (`model.ft_balance`)."""
    scope: str
    z_coef: float
    factor: float
    device: torch.device
    step: Optional[_Step] = None


def _statistics(gate_logits, num_experts, top_k, attention_mask, batch):
    """Per sequence of the `batch` rows: top-k slots per expert [B, E] (no gradient), router
    probability per expert [B, E], Σ logsumexp² [B], all summed over the layers' unmasked rows
    (Hugging Face's arithmetic: softmax in the logits' dtype, sums in float32), and tokens [B]."""
    rows = gate_logits[0].size(0)
    if attention_mask is None:
        weights = torch.ones(rows, dtype=torch.float32, device=gate_logits[0].device)
    else:
        weights = attention_mask.reshape(-1).to(device=gate_logits[0].device, dtype=torch.float32)
    if weights.numel() != rows or rows % batch:
        raise ValueError(f"fsdpturbo balance loss: the router logits have {rows} rows, the attention mask "
                         f"{weights.numel()} entries over {batch} sequences; they must match")
    slots = probs = z = 0
    for layer in gate_logits:
        routing = torch.softmax(layer, dim=-1)
        chosen = torch.topk(routing, top_k, dim=-1).indices
        taken = torch.zeros(rows, num_experts, dtype=torch.float32, device=layer.device).scatter_(1, chosen, 1.0)
        slots = slots + (taken * weights[:, None]).view(batch, -1, num_experts).sum(1)
        probs = probs + (routing.float() * weights[:, None]).view(batch, -1, num_experts).sum(1)
        z = z + (torch.logsumexp(layer.float(), dim=-1).square() * weights).view(batch, -1).sum(1)
    return slots, probs, z, weights.view(batch, -1).sum(1)


def _global_share(local, total, normaliser, factor):
    """The value `total / normaliser` (the global batch's) with the gradient of
    `factor * local / normaliser`: this rank's share, which the engine's reduction (sum over
    ranks / factor) turns into the gradient of the global value."""
    share = local * factor / normaliser
    return share + (total / normaliser - share).detach()


class _Forward:
    """One forward of a sharded model: its batch shape, and the z-loss its aux-loss call left."""

    def __init__(self, balance, shape):
        self.balance, self.shape = balance, shape
        self.collective = torch.is_grad_enabled()
        self.z_loss = None

    def losses(self, original, gate_logits, num_experts, top_k, attention_mask):
        """The aux loss to return (and the z-loss to add) for this forward's router logits."""
        balance = self.balance
        if not balance.z_coef and (balance.scope == "local" or not self.collective):
            return original(gate_logits, num_experts, top_k, attention_mask)
        if balance.scope == "sequence" and self.collective and self.shape is None:
            raise ValueError("fsdpturbo: aux_loss_scope sequence needs the batch shape; pass input_ids, inputs_embeds "
                             "or a 2-D attention_mask")
        batch = self.shape[0] if self.shape is not None else 1
        layers = len(gate_logits)
        slots, probs, z, tokens = _statistics(gate_logits, num_experts, top_k, attention_mask, batch)
        rows = layers * tokens.sum()
        if not self.collective:
            self.z_loss = z.sum() / rows.clamp(min=1)
            return original(gate_logits, num_experts, top_k, attention_mask)
        counts, prob_sum, z_sum = slots.sum(0), probs.sum(0), z.sum()
        per_sequence = num_experts * (slots * probs).sum(1) / (layers * tokens).clamp(min=1).square()
        sequences = (tokens > 0).sum().float()
        packed = torch.cat([counts, prob_sum.detach(),
                            torch.stack([rows, z_sum.detach(), per_sequence.sum().detach(), sequences])])
        if dist.is_initialized():
            dist.all_reduce(packed)
        counts_g, prob_g, (rows_g, z_g, sequence_aux_g, sequences_g) = \
            packed[:num_experts], packed[num_experts:2 * num_experts], packed[2 * num_experts:]
        step = balance.step
        token_norm = (layers * step.tokens if step is not None else rows_g).clamp(min=1)
        self.z_loss = _global_share(z_sum, z_g, token_norm, balance.factor)
        if balance.scope == "local":
            return original(gate_logits, num_experts, top_k, attention_mask)
        if balance.scope == "sequence":
            sequence_norm = (step.sequences if step is not None else sequences_g).clamp(min=1)
            return _global_share(per_sequence.sum(), sequence_aux_g, sequence_norm, balance.factor)
        fraction = counts_g / rows_g.clamp(min=1)
        return _global_share(num_experts * (fraction * prob_sum).sum(), num_experts * (fraction * prob_g).sum(),
                             token_norm, balance.factor)

    def finish(self, output):
        """Adds the z-loss to the forward's output (`z_loss`, and `loss` when there is one)."""
        coef = self.balance.z_coef
        if not coef:
            return output
        if self.z_loss is None:
            if self.collective:
                raise ValueError("fsdpturbo: dist_config.router_z_loss_coef needs the router logits; build the model "
                                 "with output_router_logits=True or pass output_router_logits=True to forward")
            return output
        if not hasattr(output, "keys"):
            raise ValueError("fsdpturbo: dist_config.router_z_loss_coef needs the model output as a ModelOutput "
                             "(return_dict=True) to add the z-loss to")
        output["z_loss"] = self.z_loss
        if output.get("loss") is not None:
            output["loss"] = output["loss"] + coef * self.z_loss.to(output["loss"].device)
        return output


def _batch_shape(args, kwargs):
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return tuple(mask.shape)
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(ids, torch.Tensor):
        return tuple(ids.shape[:2])
    embeds = kwargs.get("inputs_embeds")
    return tuple(embeds.shape[:2]) if isinstance(embeds, torch.Tensor) else None


def _patched(original):
    """`load_balancing_loss_func` that defers to Hugging Face's `original` outside a sharded
    model's forward (other models in the process are unaffected)."""

    @functools.wraps(original)
    def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        running = _RUNNING.get()
        if running is None or not isinstance(gate_logits, tuple):
            return original(gate_logits, num_experts, top_k, attention_mask)
        return running.losses(original, gate_logits, num_experts, top_k, attention_mask)

    load_balancing_loss_func.ft_original = original
    return load_balancing_loss_func


def _modeling_module(model):
    for cls in type(model).__mro__:
        if cls.__module__ in _MODELING:
            return sys.modules[cls.__module__]
    return None


def install(model, *, scope, z_coef, factor, device, cp_size=1):
    """Gives `model` (a Hugging Face Qwen3-MoE / Qwen3.5-MoE model being sharded; `factor`: the
    engine's gradient divide factor) the balance losses of the module docstring. Another model
    type keeps Hugging Face's per-rank aux loss (a warning when it outputs router logits);
    `sequence` scope or a z-loss on it, and `sequence` scope with cp > 1 (a sequence spread over
    ranks), are NotImplementedError."""
    module = _modeling_module(model)
    if module is None:
        if scope == "sequence" or z_coef:
            raise NotImplementedError(f"fsdpturbo: aux_loss_scope sequence and router_z_loss_coef are built for the "
                                      f"Qwen3-MoE and Qwen3.5-MoE models, not {type(model).__name__}")
        if scope == "global" and getattr(getattr(model, "config", None), "output_router_logits", False):
            logger.warning("fsdpturbo: %s keeps Hugging Face's per-rank aux loss (the global-batch aux loss is built "
                           "for Qwen3-MoE and Qwen3.5-MoE)", type(model).__name__)
        return model
    if scope == "sequence" and cp_size > 1:
        raise NotImplementedError("fsdpturbo: aux_loss_scope sequence with cp_size > 1 is not built (each rank "
                                  "holds part of every sequence); use global or local")
    if not hasattr(module.load_balancing_loss_func, "ft_original"):
        module.load_balancing_loss_func = _patched(module.load_balancing_loss_func)
    original = getattr(model.forward, "__func__", None)
    if getattr(model.forward, "__self__", None) is not model or original is None:
        raise ValueError(f"fsdpturbo: {type(model).__name__}.forward is not a method of the model (replaced by a "
                         f"function?); shard the model before wrapping its forward")
    model.ft_balance = Balance(scope=scope, z_coef=float(z_coef), factor=float(factor), device=torch.device(device))

    @functools.wraps(original)  # the model's signature (trainers read its parameter names)
    def forward(self, *args, **kwargs):
        balance, shape = self.ft_balance, _batch_shape(args, kwargs)
        running = _Forward(balance, shape)
        if running.collective and balance.step is not None:
            balance.step.next_forward(shape)
        token = _RUNNING.set(running)
        try:
            output = original(self, *args, **kwargs)
        finally:
            _RUNNING.reset(token)
        return running.finish(output)

    model.forward = types.MethodType(forward, model)  # a copy.deepcopy of the model rebinds it
    return model


@contextlib.contextmanager
def balance_step(model, attention_masks):
    """Gradient accumulation with the step's normaliser. `attention_masks`: the [batch, seq]
    attention masks of this rank's micro-batches of the optimizer step, in the order their
    forwards run inside the context (`torch.ones` where nothing is padded). On entry one
    all-reduce gives the step's global token count T and sequence count S (rows with a token).
    Inside, micro-batch m (n_m tokens over all ranks) gets, instead of its own normalisers:

    * z-loss: Σ logsumexp² / (L · T), so the step's sum is the z-loss of the whole step (exact);
    * `sequence` aux: Σ over its sequences / S, so the step's sum is the mean over the step's
      sequences (exact);
    * `global` aux: (n_m / T) × its global-batch aux loss. The aux loss of ONE forward over the
      whole step is not reproduced: it multiplies the step's f (expert fractions) by its P,
      and the f of later micro-batches is unknown when an earlier one runs backward;
    * `local` aux: Hugging Face's value, unweighted.

    `output.aux_loss` / `output.z_loss` are these weighted values: summed over the step they
    give the step's. The cross-entropy is the trainer's (e.g. Hugging Face's
    `num_items_in_batch`). A forward whose mask shape differs from the declared one, more
    forwards than masks, or fewer at exit are ValueErrors. Collective."""
    balance = getattr(model, "ft_balance", None)
    if balance is None:
        raise ValueError("fsdpturbo.balance_step: the model has no balance losses (shard_model installs them on "
                         "Qwen3-MoE and Qwen3.5-MoE models)")
    masks = list(attention_masks)
    if not masks or any(not isinstance(m, torch.Tensor) or m.dim() != 2 for m in masks):
        raise ValueError("fsdpturbo.balance_step: attention_masks must be the step's [batch, seq] attention mask "
                         "tensors, one per micro-batch")
    totals = sum(torch.stack([m.sum(), (m.sum(-1) > 0).sum()]).to(balance.device, torch.float64) for m in masks)
    if dist.is_initialized():
        dist.all_reduce(totals)
    totals = totals.float()
    balance.step = _Step(tokens=totals[0], sequences=totals[1], shapes=[tuple(m.shape) for m in masks])
    try:
        yield
    finally:
        step, balance.step = balance.step, None
    if step.ran != len(step.shapes):
        raise ValueError(f"fsdpturbo.balance_step: the step declared {len(step.shapes)} micro-batches and "
                         f"{step.ran} forwards ran")
