"""The seed's `fsdp_turbo.ops.registry`. `_OPERATOR_REGISTRY` is a read-only live view
(operator -> {device type -> callable}); register through `register_op`."""
from fsdpturbo.registry import OperatorRegistryView, dispatch_op, get_op, register_op

_OPERATOR_REGISTRY = OperatorRegistryView()

__all__ = ["_OPERATOR_REGISTRY", "dispatch_op", "get_op", "register_op"]
