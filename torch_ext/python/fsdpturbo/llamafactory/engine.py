"""The FSDP2 engine LlamaFactory's `fsdpturbo` backend drives: `FSDP2Engine` (the outer FSDP2
over dp, materialisation and weight loading, grad-norm warm-up) and `FSDPTurboFSDP2Engine`
(storage dtype and the expert-sharding step of `fsdpturbo.engine`, on LlamaFactory's meshes)."""
import os

import torch

from .. import adapters, norm
from .._dist import rank
from ..config import TrainConfig
from ..engine import _apply_expert_sharding, _cast_to_storage_dtype, _default_device, fully_shard_outer, materialize
from ..moe import expert_lora
from ..placement import copy_weights_
from ..spec import FSDPTurboEPModelSpec
from ..weights import save_hf_weights
from . import state as _state


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
        if processor is not None and rank() == 0:
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
        return torch.device(self.device) if self.device is not None else _default_device(self._mesh().device_type)

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
    `FSDPTurboParams` (name, ep_size, ep_dispatcher, fsdp_ignored_modules, hook_modules,
    fsdp_implementation, reshard_after_forward, …; our extensions such as `efsdp_size`
    optional), parsed and validated by the Rust core into `config` (a `TrainConfig`, with
    `bf16`) when the engine is made. The parallel state (`get_fsdpturbo_parallel_state()`) must
    be initialised before `shard_model`, or is initialised then from `dist_interface`. Making
    one touches no mesh. A PEFT model (LlamaFactory's LoRA) is sharded through the model inside
    it and stays the model the trainer holds, as `fsdpturbo.shard_model` does it: with ep > 1
    its adapters on the experts (`target_parameters`) move onto the expert modules first
    (`fsdpturbo.moe.expert_lora`)."""

    def __init__(self, dist_config, bf16=False, *, dist_interface=None, dp_mesh=None, weights=None, device=None):
        super().__init__(dist_config, dist_interface=dist_interface, dp_mesh=dp_mesh, weights=weights, device=device)
        self.config = TrainConfig({"bf16": bool(bf16), "dist_config": self.dist_config})

    def _parallel_state(self):
        state = _state.get_fsdpturbo_parallel_state()
        if self.dist_interface is not None and not state.initialized:
            state.initialize(self.dist_interface, self.dist_config)
        if not state.initialized:
            raise RuntimeError("FSDPTurbo parallel state is not initialized: construct the engine with "
                               "dist_interface=<LlamaFactory's DistributedInterface>, or initialize "
                               "get_fsdpturbo_parallel_state() before shard_model")
        return state

    def _shard_experts(self, model):
        """The model type's spec (the seed's error without one, also with ep_size 1), then the
        expert-sharding step of `fsdpturbo.engine` on the parallel state's topology and meshes,
        with EFSDP only when efsdp > 1, as LlamaFactory does (with efsdp = 1 expert parallelism
        alone reduces the expert gradients). Its EP and EFSDP functions are looked up at call
        time on their `fsdp_turbo` modules, so a trainer's monkeypatches of those apply.
        Returns (the model, inside its PEFT model if any; the plan; parameters the outer FSDP2
        ignores)."""
        from fsdp_turbo.distributed.expert_parallel import expert_fully_shard_parallel, expert_parallel

        model = expert_lora.inner_model(model)
        if FSDPTurboEPModelSpec.get(model) is None:
            model_type = getattr(getattr(model, "config", None), "model_type", None)
            raise ValueError(f"No FSDPTurbo EP spec is registered for model_type={model_type}.")
        state = self._parallel_state()
        return _apply_expert_sharding(model, self.config, state.topology, state.ep_mesh, state.efsdp_mesh,
                                      efsdp_of_size_one=False,
                                      parallelize=expert_parallel.expert_parallelize_modules,
                                      fully_shard=expert_fully_shard_parallel.expert_fully_shard_modules)

    def prepare_model_ep(self, model):
        """The seed's EP step: returns (model, the set of parameters the outer FSDP2 ignores)."""
        _, _, ignored = self._shard_experts(model)
        return model, set(ignored)

    def prepare_model(self, model, ignored_params=None):
        """The EP step, then the outer FSDP2 over dp with the plan's divide factor (dp · cp).
        Returns `model`."""
        inner, plan, ignored = self._shard_experts(model)
        fully_shard_outer(inner, self._mesh(), plan["gradient_divide_factor"],
                          ignored_params=set(ignored) | set(ignored_params or ()),
                          reshard_after_forward=self.config.values["dist"]["reshard_after_forward"])
        return model

    def shard_model(self, model):
        """Casts the parameters to the storage dtype (bf16 with `bf16=True`, else float32), then
        runs `FSDP2Engine.shard_model` on the model (inside its PEFT model, whose
        `load_state_dict` then also takes the experts in PEFT's layout:
        `fsdpturbo.adapters.guard_taken_over`). Returns the model."""
        given, inner = model, expert_lora.inner_model(model)
        super().shard_model(_cast_to_storage_dtype(inner, self.config.values["bf16"]))
        adapters.guard_taken_over(given, inner)
        return given
