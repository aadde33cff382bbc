"""Ulysses context parallelism: each rank of a Ulysses group holds one contiguous chunk of
every sequence. `full_attention` switches to the head-sharded layout over the whole sequence
and back with two all-to-alls; `gated_delta_net` (Qwen3.5's linear attention) is head-parallel
over the whole sequence; `causal_lm_loss` shifts the labels across the chunks and takes the
mean over all of them. `apply_cp_plan` installs a `cp_plan` on a model (`plan`)."""
from .plan import FUNCTION_TYPES, LOSS_TYPES, apply_cp_plan, entry_problems
from .sequence import all_to_all, chunk, gather, gather_sequence

__all__ = ["FUNCTION_TYPES", "LOSS_TYPES", "all_to_all", "apply_cp_plan", "chunk", "entry_problems", "gather",
           "gather_sequence"]
