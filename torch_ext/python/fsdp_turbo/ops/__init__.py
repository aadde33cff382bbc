"""The seed's `fsdp_turbo.ops`: the device-operator registry (backed by libfsdpturbo's).
`import fsdp_turbo.ops.fla` registers the flash-linear-attention kernels."""
from .registry import _OPERATOR_REGISTRY, dispatch_op, get_op, register_op

__all__ = ["_OPERATOR_REGISTRY", "dispatch_op", "get_op", "register_op"]
