"""The seed's `fsdp_turbo.ops.fla`: importing it registers `chunk_gated_delta_rule` and
`fused_recurrent_gated_delta_rule` (flash-linear-attention) for "cuda" and "npu"."""
from fsdpturbo.fla import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]
