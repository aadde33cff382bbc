"""Model specs and plan resolution from the Rust core: which modules are experts and EFSDP
units, which parameters the outer FSDP2 ignores, and the gradient divide factor."""
import ctypes
import json

from . import _abi
from ._native import check, lib, string_out
from .config import config_handle

_c = ctypes


ModelDesc = _abi.fsdpturbo_model_desc_t  # a model by module names and parameter names and shapes


def _strings(items):
    encoded = [s.encode() for s in items]
    return (_c.c_char_p * max(len(encoded), 1))(*encoded), len(encoded)


def register_model_spec(model_type, ep_modules, ep_fsdp_modules=None):
    """Registers (or replaces) the spec of `model_type` in the process-wide registry the plan
    reads: the expert module patterns and the EFSDP unit patterns (None: each expert pattern
    without its `.experts` suffix). Invalid patterns raise and register nothing."""
    ep, n_ep = _strings(list(ep_modules))
    if ep_fsdp_modules is None:
        check(lib.fsdpturbo_spec_register(model_type.encode(), ep, n_ep, None, 0))
    else:
        fsdp, n_fsdp = _strings(list(ep_fsdp_modules))
        check(lib.fsdpturbo_spec_register(model_type.encode(), ep, n_ep, fsdp, n_fsdp))


def get_model_spec(model_type):
    """The registered spec of `model_type` as a dict (model_type, ep_modules, ep_fsdp_modules);
    an unregistered type raises the seed's error listing the registered ones."""
    return json.loads(string_out(lib.fsdpturbo_spec_to_json, model_type.encode()))


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
        modules, n_modules = _strings([name for name, _ in model.named_modules()])
        named = list(model.named_parameters())
        names, n_params = _strings([name for name, _ in named])
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
