"""Plan resolution from the Rust core: which modules are experts and EFSDP units, which
parameters the outer FSDP2 ignores, and the gradient divide factor (the specs it reads:
fsdpturbo.spec)."""
import ctypes
import json

from . import _abi
from ._native import c_strings, check, lib, string_out
from .config import config_handle

_c = ctypes


ModelDesc = _abi.fsdpturbo_model_desc_t  # a model by module names and parameter names and shapes


def _model_type(model):
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not model_type:
        raise ValueError(f"fsdpturbo: {type(model).__qualname__} has no config.model_type; the plan needs "
                         f"the model type to find its spec")
    return model_type


def resolve_plan(model, train_config, state):
    """The plan of `model` (an nn.Module, possibly on meta) under `train_config` (a `TrainConfig`,
    read as parsed, or anything `parse_train_config` accepts) and `state` (a ParallelState), as
    a dict: `ep_modules` ([{name, num_global_experts, num_local_experts}]), `efsdp_modules`,
    `hook_modules`, `params` ([{name, shape, role}], role one of expert, ignored, dense),
    `ignored_params`, `gradient_divide_factor`, `seed_gradient_divide_factor`, `warnings`."""
    with config_handle(train_config) as config:
        modules, n_modules = c_strings([name for name, _ in model.named_modules()])
        named = list(model.named_parameters())
        names, n_params = c_strings([name for name, _ in named])
        ndims = (_c.c_size_t * max(len(named), 1))(*[p.dim() for _, p in named])
        dims = [int(d) for _, p in named for d in p.shape]
        shapes = (_c.c_uint64 * max(len(dims), 1))(*dims)
        desc = ModelDesc(ctypes.sizeof(ModelDesc), _model_type(model).encode(), modules, n_modules,
                         names, ndims, shapes, n_params)
        plan = _c.c_void_p()
        check(lib.fsdpturbo_plan_resolve(_c.byref(desc), config, state._handle, _c.byref(plan)))
        try:
            return json.loads(string_out(lib.fsdpturbo_plan_to_json, plan))
        finally:
            lib.fsdpturbo_plan_free(plan)
