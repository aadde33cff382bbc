"""The seed's `fsdp_turbo.utils.str_match`."""
from fsdpturbo.pattern import module_name_match

__all__ = ["module_name_match"]
