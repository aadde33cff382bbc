"""The seed's `fsdp_turbo.utils.patch`."""
from fsdpturbo.patch import (PATCH_IDS_ATTR, apply_module_patch, callable_id, import_module_or_suffix,
                             patch_model_members, resolve_callable, resolve_class_member)

__all__ = ["PATCH_IDS_ATTR", "apply_module_patch", "callable_id", "import_module_or_suffix", "patch_model_members",
           "resolve_callable", "resolve_class_member"]
