"""fsdp_turbo.distributed (compatibility paths)."""
