"""The seed's `fsdp_turbo.distributed.expert_parallel.expert_fully_shard_parallel`."""
from fsdpturbo.efsdp import expert_fully_shard_modules, get_fsdp_hook_modules

__all__ = ["expert_fully_shard_modules", "get_fsdp_hook_modules"]
