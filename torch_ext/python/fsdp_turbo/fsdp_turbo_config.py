"""The seed's `fsdp_turbo.fsdp_turbo_config`."""
from fsdpturbo.efsdp import FSDPPlanConfig
from fsdpturbo.ep import EPPlanConfig

__all__ = ["EPPlanConfig", "FSDPPlanConfig"]
