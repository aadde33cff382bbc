"""The FSDP2 engine LlamaFactory's `fsdpturbo` backend drives: `FSDP2Engine` (the outer FSDP2
over dp, materialisation and weight loading, grad-norm warm-up) and `FSDPTurboFSDP2Engine`
(storage dtype, the EP and EFSDP step, the loader's `_copy_weights`)."""
import logging
import os

import torch
import torch.distributed as dist

from .. import norm
from ..engine import fully_shard_outer, materialize
from ..placement import copy_weights_
from ..pattern import Pattern
from ..weights import save_hf_weights
from . import state as _state
from ..spec import FSDPTurboEPModelSpec, get_ep_fsdp_modules

logger = logging.getLogger(__name__)


def _rank():
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _info_rank0(message, *args):
    if _rank() == 0:
        logger.info(message, *args)


def save_checkpoint(model, optimizer, ckpt_dir, **kwargs):
    """LlamaFactory's fsdp2 `save_checkpoint` call: `fsdpturbo.save_checkpoint` (model/ and
    optimizer/ as LlamaFactory writes them, plus `extra=` when given, RNG states and an atomic
    replace), and with `save_ckpt_as_hf=True` the full Hugging Face weights (and `processor`)
    in `ckpt_dir/hf_model`. Collective."""
    from ..checkpoint import save_checkpoint as save

    save(model, optimizer, ckpt_dir, extra=kwargs.get("extra"))
    if kwargs.get("save_ckpt_as_hf"):
        hf_dir = os.path.join(os.fspath(ckpt_dir), "hf_model")
        save_hf_weights(getattr(model, "module", model), hf_dir)
        processor = kwargs.get("processor")
        if processor is not None and _rank() == 0:
            processor.save_pretrained(hf_dir)


def load_checkpoint(model, optimizer, ckpt_dir, **kwargs):
    """LlamaFactory's fsdp2 `load_checkpoint` call: `fsdpturbo.load_checkpoint` at whatever
    layout `model` is sharded now (checkpoints of either side). Returns the saved `extra`."""
    from ..checkpoint import load_checkpoint as load

    return load(model, optimizer, ckpt_dir, extra=kwargs.get("extra"))


class FSDP2Engine:
    """The outer FSDP2: `shard_model(model)` runs `prepare_model` (wrapping every decoder layer
    and the root over `fsdp_mesh`), materialises meta tensors on the mesh's device, loads
    `weights` (a Hugging Face safetensors checkpoint) through `_copy_weights`, and warms up the
    grad norm. Gradients: summed over dp and cp, divided by `gradient_divide_factor()`."""

    fsdp_mesh = weights = device = dist_interface = None

    def __init__(self, dist_config, *, dist_interface=None, dp_mesh=None, weights=None, device=None):
        self.dist_config = dict(dist_config or {})
        self.dist_interface = dist_interface
        self.fsdp_mesh = dp_mesh
        self.weights = weights
        self.device = device

    def _mesh(self):
        if self.fsdp_mesh is None and self.dist_interface is not None:
            self.fsdp_mesh = self.dist_interface.get_device_mesh(_state.DP)
        if self.fsdp_mesh is None:
            raise RuntimeError("FSDPTurbo FSDP2: no dp mesh; construct the engine with dp_mesh=<the 'dp' DeviceMesh> "
                               "or a dist_interface that has one")
        return self.fsdp_mesh

    def _device(self):
        if self.device is not None:
            return torch.device(self.device)
        device_type = self._mesh().device_type
        if device_type == "cpu":
            return torch.device("cpu")
        return torch.device(device_type, torch.get_device_module(device_type).current_device())

    def gradient_divide_factor(self):
        """F under LlamaFactory's loss convention: dp · cp, the size of the data mesh (dp, cp).
        The trainer scales each rank's loss by dp / global tokens, and with context parallelism
        every cp rank backpropagates its sequence's whole loss (its numerators are all-gathered
        over the cp group, whose backward sums the cp copies), so a gradient summed over dp and
        cp is dp · cp times the mean's; LlamaFactory's fsdp2 divides by its world mesh alike."""
        return float(self._mesh()._get_root_mesh().size())

    def prepare_model(self, model, ignored_params=None):
        return fully_shard_outer(model, self._mesh(), self.gradient_divide_factor(),
                                 ignored_params=ignored_params or (),
                                 reshard_after_forward=bool(self.dist_config.get("reshard_after_forward", True)))

    def _copy_weights(self, param, loaded_tensor):
        copy_weights_(param, loaded_tensor)

    def _warmup_grad_norm(self, model):
        if self.fsdp_mesh is None:
            return
        norm.warmup_grad_norm(model)

    def shard_model(self, model):
        model = self.prepare_model(model)
        # The default `_copy_weights` is `copy_weights_`'s slice, which the loader reads shard by shard;
        # an override gets every full tensor.
        custom = type(self)._copy_weights is not FSDP2Engine._copy_weights
        materialize(model, self._device(), self.weights, copy_fn=self._copy_weights if custom else None)
        self._warmup_grad_norm(model)
        return model

    def save_model(self, model, path):
        """Gathers the full state dict on every rank; rank 0 writes a Hugging Face checkpoint."""
        return save_hf_weights(model, path)


class FSDPTurboFSDP2Engine(FSDP2Engine):
    """LlamaFactory's `FSDPTurboFSDP2Engine(dist_config, bf16=...)`: `dist_config` is the dict of
    `FSDPTurboParams` (ep_size, ep_dispatcher, fsdp_ignored_modules, hook_modules,
    fsdp_implementation, reshard_after_forward, …; our `efsdp_size` optional). The parallel
    state (`get_fsdpturbo_parallel_state()`) must be initialised before `shard_model`, or is
    initialised then from `dist_interface`. Making one touches no mesh."""

    ep_fsdp_size = None  # None: the parallel state's efsdp size, read when sharding

    def __init__(self, dist_config, bf16=False, *, dist_interface=None, dp_mesh=None, weights=None, device=None):
        super().__init__(dist_config, dist_interface=dist_interface, dp_mesh=dp_mesh, weights=weights, device=device)
        self.mixed_precision = "bf16" if bf16 else "fp32"
        self.ep_size = int(self.dist_config.get("ep_size", 1))

    def _parallel_state(self):
        state = _state.get_fsdpturbo_parallel_state()
        if self.dist_interface is not None and not state.initialized:
            state.initialize(self.dist_interface, self.dist_config)
        return state

    def prepare_model_ep(self, model):
        """The seed's EP step: the model type's spec (also required with ep_size 1), its prepare
        function, then with ep > 1 `expert_parallelize_modules` and `expert_fully_shard_modules`
        (looked up at call time on their fsdp_turbo modules) with `gradient_divide_factor()`; as
        LlamaFactory does, EFSDP only when efsdp > 1 (with efsdp = 1 expert parallelism alone
        reduces the expert gradients). Returns (model, parameters the outer FSDP2 ignores)."""
        from fsdp_turbo.distributed.expert_parallel import expert_fully_shard_parallel, expert_parallel
        from fsdp_turbo.fsdp_turbo_config import EPPlanConfig, FSDPPlanConfig

        spec = FSDPTurboEPModelSpec.get(model)
        if spec is None:
            model_type = getattr(getattr(model, "config", None), "model_type", None)
            raise ValueError(f"No FSDPTurbo EP spec is registered for model_type={model_type}.")
        model = spec.prepare(model)
        ignored_patterns = list(self.dist_config.get("fsdp_ignored_modules", []))
        if self.ep_size > 1:
            state = self._parallel_state()
            efsdp_size = self.ep_fsdp_size if self.ep_fsdp_size is not None else state.efsdp_size
            ep_plan = EPPlanConfig(apply_modules=spec.ep_modules,
                                   dispatcher=self.dist_config.get("ep_dispatcher", "eager"),
                                   apply_efsdp_modules=get_ep_fsdp_modules(spec))
            # The seed: ep · efsdp, which is right only when edp = cp = 1.
            ep_plan.gradient_divide_factor = self.gradient_divide_factor()
            fsdp_plan = FSDPPlanConfig(apply_modules={},
                                       hook_modules=self.dist_config.get("hook_modules", []),
                                       fsdp_implementation=self.dist_config.get("fsdp_implementation", "native"))
            if state.ep_mesh is None:
                raise RuntimeError("FSDPTurbo EP mesh is not initialized.")
            if efsdp_size > 1 and state.efsdp_mesh is None:
                raise RuntimeError("FSDPTurbo EFSDP mesh is not initialized.")
            _info_rank0("Applying FSDPTurbo EP backend.")
            _info_rank0("FSDPTurbo EP apply patterns: %s", ep_plan.apply_modules)
            _info_rank0("FSDPTurbo EP device mesh: %s", state.ep_mesh)
            _info_rank0("FSDPTurbo EP gradient divide factor: %s", ep_plan.gradient_divide_factor)
            model = expert_parallel.expert_parallelize_modules(model, state.ep_mesh, ep_plan)
            if efsdp_size > 1:
                _info_rank0("FSDPTurbo EFSDP apply patterns: %s", ep_plan.apply_efsdp_modules)
                _info_rank0("FSDPTurbo EFSDP device mesh: %s", state.efsdp_mesh)
                model = expert_fully_shard_parallel.expert_fully_shard_modules(model, state.efsdp_mesh, ep_plan,
                                                                               fsdp_plan)
            ignored_patterns += list(spec.ep_modules)
        patterns = [Pattern(p) for p in ignored_patterns]
        ignored = set()
        for name, module in model.named_modules():
            if any(p.match(name) for p in patterns):
                ignored.update(module.parameters())
        if ignored:
            _info_rank0("FSDPTurbo FSDP2: Ignoring %d EP parameters in outer FSDP.", len(ignored))
        return model, ignored

    def prepare_model(self, model, ignored_params=None):
        model, ignored = self.prepare_model_ep(model)
        return super().prepare_model(model, ignored_params=set(ignored) | set(ignored_params or ()))

    def shard_model(self, model):
        """Casts the parameters to the storage dtype (bf16 with `bf16=True`, else float32), then
        runs `FSDP2Engine.shard_model`. Returns the model."""
        dtype = torch.bfloat16 if self.mixed_precision == "bf16" else torch.float32
        _info_rank0("Using %s for FSDPTurbo full tuning.", dtype)
        model = model.to(dtype)
        return super().shard_model(model)
