"""fsdp_turbo.utils (compatibility paths)."""
