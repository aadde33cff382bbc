"""The seed's `fsdp_turbo.distributed.expert_parallel.expert_parallel`."""
from fsdpturbo.ep import expert_parallelize_modules, get_dispatcher_fn

__all__ = ["expert_parallelize_modules", "get_dispatcher_fn"]
