"""Ulysses context parallelism for the tests that drive `fsdpturbo.engine.shard_model` the way
LlamaFactory's and verl's CP drive it: the package's own (`fsdpturbo.ulysses`) installed on a
sharded model. Each rank of a CP group holds one contiguous chunk of every sequence; full
attention switches to the head-sharded layout over the whole sequence and back; Qwen3.5's
linear attention is head-parallel over the whole sequence; the loss is the whole sequence's
on every CP rank (as LlamaFactory's `sequence_parallel_loss` gives it), so every rank's
gradient is cp × its chunk's share: summed over the world and divided by the world size it is
the gradient of the mean over the data-parallel ranks' losses."""
import torch.nn.functional as F

from fsdpturbo.ulysses import apply_cp_plan, chunk, gather_sequence
from fsdpturbo.ulysses.loss import causal_lm_loss as _ulysses_loss

__all__ = ["IGNORE_INDEX", "causal_lm_loss", "chunk", "gather_sequence", "install", "shifted_labels"]

IGNORE_INDEX = -100


def _modeling(module):
    """The Hugging Face class of `module` (FSDP2 wraps it in a subclass of its own)."""
    return next(c for c in type(module).__mro__ if c.__module__.startswith("transformers.models."))


def install(model, group):
    """Makes `model` (a Qwen3-MoE or Qwen3.5-MoE causal LM) take sequence chunks on the ranks
    of `group`: the package's full_attention around its eager attention, and gated_delta_net
    for its linear attention (verl's cp_plan); no loss patch (the tests take the loss from the
    logits, `causal_lm_loss`)."""
    from fsdp_turbo.fsdp_turbo_config import CPPlanConfig

    model.set_attn_implementation("eager")
    patches = [{"target_functions": [f"{_modeling(model).__module__}.eager_attention_forward"],
                "type": "full_attention"}]
    linear = {f"{_modeling(m).__module__}.{_modeling(m).__qualname__}.forward"
              for m in model.modules() if hasattr(m, "in_proj_qkv")}
    if linear:
        patches.append({"target_functions": sorted(linear), "type": "gated_delta_net"})
    problems = apply_cp_plan(model, group, CPPlanConfig(ulysses_function_patches=patches))
    assert not problems, problems
    return model


def shifted_labels(ids):
    """Next-token targets of the whole sequences `ids` [B, S] (the last has none)."""
    return F.pad(ids[:, 1:], (0, 1), value=IGNORE_INDEX)


def causal_lm_loss(logits, labels, group):
    """Mean next-token cross entropy over the whole sequences: `logits` [B, S/cp, V] of this
    rank's chunk, `labels` [B, S] of the whole sequences (`shifted_labels`)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return _ulysses_loss(ForCausalLMLoss, group)(logits, None, logits.shape[-1], shift_labels=chunk(labels, group))
