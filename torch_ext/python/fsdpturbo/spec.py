"""Model specs: which modules of a model type are experts and EFSDP units. The patterns live in
the Rust spec registry, which the plan reads (`register_model_spec`, `get_model_spec`);
`FSDPTurboEPModelSpec`, the registry the engine and LlamaFactory's EP step read, adds the
Python prepare functions."""
import dataclasses
import json
import logging
from typing import Callable, ClassVar, Dict, List, Optional

from ._native import c_strings, check, lib, string_out

logger = logging.getLogger(__name__)


def register_model_spec(model_type, ep_modules, ep_fsdp_modules=None):
    """Registers (or replaces) the spec of `model_type` in the process-wide registry the plan
    reads: the expert module patterns and the EFSDP unit patterns (None: each expert pattern
    without its `.experts` suffix). Invalid patterns raise and register nothing."""
    ep, n_ep = c_strings(list(ep_modules))
    fsdp, n_fsdp = (None, 0) if ep_fsdp_modules is None else c_strings(list(ep_fsdp_modules))
    check(lib.fsdpturbo_spec_register(model_type.encode(), ep, n_ep, fsdp, n_fsdp))


def get_model_spec(model_type):
    """The registered spec of `model_type` as a dict (model_type, ep_modules, ep_fsdp_modules);
    an unregistered type raises the seed's error listing the registered ones."""
    return json.loads(string_out(lib.fsdpturbo_spec_to_json, model_type.encode()))


@dataclasses.dataclass
class FSDPTurboEPModelSpec:
    model_type: str
    ep_modules: List[str]
    ep_fsdp_modules: Optional[List[str]] = None
    prepare_fn: Optional[Callable] = None

    _registry: ClassVar[Dict[str, "FSDPTurboEPModelSpec"]] = {}

    @classmethod
    def register(cls, model_type, ep_modules, ep_fsdp_modules=None):
        """Decorator: registers (or replaces) the spec of `model_type` with the decorated function
        as its prepare step, here and in the Rust registry; returns the function unchanged."""
        def decorator(fn):
            register_model_spec(model_type, ep_modules, ep_fsdp_modules)
            cls._registry[model_type] = cls(model_type, list(ep_modules),
                                            None if ep_fsdp_modules is None else list(ep_fsdp_modules), fn)
            return fn
        return decorator

    @classmethod
    def get(cls, model):
        """The spec of `model.config.model_type`, or None (no config, no model type, not registered)."""
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if not model_type:
            return None
        return cls._registry.get(model_type)

    def prepare(self, model):
        return self.prepare_fn(model) if self.prepare_fn is not None else model


def get_ep_fsdp_modules(spec):
    """The EFSDP patterns of `spec`: its own, else each expert pattern without `.experts`."""
    if spec.ep_fsdp_modules is not None:
        return list(spec.ep_fsdp_modules)
    return [p[: -len(".experts")] if p.endswith(".experts") else p for p in spec.ep_modules]


def _builtin(model_type, prepare_fn=None):
    spec = get_model_spec(model_type)
    FSDPTurboEPModelSpec._registry[model_type] = FSDPTurboEPModelSpec(
        model_type, spec["ep_modules"], spec["ep_fsdp_modules"], prepare_fn)


def _prepare_qwen3_moe(model):
    """Transformers 5.x sparse experts name their width `hidden_dim`; add `hidden_size`."""
    prepared = 0
    for module in model.modules():
        if all(hasattr(module, a) for a in ("gate_up_proj", "down_proj", "hidden_dim", "num_experts")):
            if not hasattr(module, "hidden_size"):
                module.hidden_size = module.hidden_dim
            prepared += 1
    if prepared:
        logger.info("FSDPTurbo EP adapter: prepared %d sparse expert modules for Transformers 5.x.", prepared)
    else:
        logger.info("FSDPTurbo EP adapter did not find a sparse expert module requiring preparation.")
    return model


_builtin("qwen3_moe", _prepare_qwen3_moe)
_builtin("qwen3_5_moe")
