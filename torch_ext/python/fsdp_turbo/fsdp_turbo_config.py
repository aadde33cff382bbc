"""The seed's `fsdp_turbo.fsdp_turbo_config`."""
from fsdpturbo.ep import EPPlanConfig

__all__ = ["EPPlanConfig"]
