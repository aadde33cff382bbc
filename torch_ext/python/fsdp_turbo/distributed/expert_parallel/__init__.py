"""fsdp_turbo.distributed.expert_parallel (compatibility paths)."""
