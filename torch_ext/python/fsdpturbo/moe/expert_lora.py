"""LoRA on the experts: a PEFT model's adapters on 3-D expert weights (PEFT ≥ 0.17,
`LoraConfig(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])`) in
the layout expert parallelism and expert FSDP shard.

PEFT wraps the experts module in one `ParamWrapper` per targeted weight (nested, the first
target innermost) and folds each expert's rank-r pair of a weight W [E, d1, d2] into two
matrices; W_e becomes W_e + s·ΔW_e with (peft/tuners/lora/layer.py, `get_delta_weight`)

    lora_A [r·E, d1]: row e·r + k        ΔW_e[o, i] = Σ_k lora_A[e·r + k, o] · lora_B[i, k·E + e]
    lora_B [d2, r·E]: column k·E + e

and s = lora_alpha / r (/ √r with rsLoRA). Hugging Face's experts apply W_e [out, in] as
x·W_eᵀ, so d1 is the output and d2 the input side. lora_B interleaves the experts, so neither
matrix splits by expert into blocks: `take_over` replaces each wrapper chain by its experts
module, which gets per adapted weight two parameters with the experts on dim 0 (split over ep
and efsdp with the weight itself):

    {weight}_lora_down [E, r, in]   down[e, k, i] = lora_B[i, k·E + e]
    {weight}_lora_up   [E, out, r]  up[e, o, k]   = lora_A[e·r + k, o]

so ΔW_e = up_e · down_e, and the experts compute x·W_eᵀ + s·(x·down_eᵀ)·up_eᵀ on their routed
rows (`fsdpturbo.moe.dispatch.experts.ExpertProjection`: rank-r matmuls, never a merged copy of
W). A weightless child module `lora` (`ExpertLoRA`, a PEFT tuner layer, so PEFT's
`disable_adapter()` switches it) keeps each adapter's rank, scaling and place in PEFT's names.
`peft_names` maps the module's parameters to the names and layout of the PEFT model it came
from (what `fsdpturbo.adapters` saves and loads).
"""
import collections
import dataclasses
import functools
from typing import Callable

from torch import nn

ADAPTED_WEIGHTS = ("gate_up_proj", "down_proj")  # the expert weights the dispatchers apply


@dataclasses.dataclass(frozen=True)
class Adapter:
    """The LoRA adapter on one expert weight: rank r, scaling s, and the path of its PEFT
    wrapper below the experts module's place in the PEFT model ("", ".base_layer", ...)."""
    rank: int
    scaling: float
    peft_path: str


def down_name(weight):
    return f"{weight}_lora_down"


def up_name(weight):
    return f"{weight}_lora_up"


def engine_factors(lora_a, lora_b, num_experts):
    """PEFT's (lora_A [r·E, out], lora_B [in, r·E]) of one expert weight as the engine's
    (down [E, r, in], up [E, out, r]), new contiguous tensors."""
    return (engine_down(lora_b.detach(), num_experts).contiguous(),
            engine_up(lora_a.detach(), num_experts).contiguous())


def peft_lora_a(up):
    """PEFT's lora_A [r·E, out] of the engine's up [E, out, r]."""
    return up.transpose(1, 2).reshape(-1, up.size(1))


def peft_lora_b(down):
    """PEFT's lora_B [in, r·E] of the engine's down [E, r, in]."""
    return down.permute(2, 1, 0).reshape(down.size(2), -1)


def engine_down(lora_b, num_experts):
    """The engine's down [E, r, in] of PEFT's lora_B [in, r·E]."""
    return lora_b.reshape(lora_b.size(0), -1, num_experts).permute(2, 1, 0)


def engine_up(lora_a, num_experts):
    """The engine's up [E, out, r] of PEFT's lora_A [r·E, out]."""
    return lora_a.reshape(num_experts, -1, lora_a.size(1)).transpose(1, 2)


PeftClasses = collections.namedtuple("PeftClasses", "ParamWrapper BaseTunerLayer PeftModel")


@functools.cache
def peft_classes():
    """PEFT's classes this package meets (`PeftClasses`), or None when PEFT is not installed
    (then no model has its wrappers)."""
    try:
        from peft import PeftModel
        from peft.tuners.lora.layer import ParamWrapper
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return None
    return PeftClasses(ParamWrapper, BaseTunerLayer, PeftModel)


@functools.cache
def _expert_lora_class():
    base_tuner_layer = peft_classes().BaseTunerLayer

    class ExpertLoRA(nn.Module, base_tuner_layer):
        """The LoRA adapters of an experts module (`adapters`: expert weight → `Adapter`; the
        factors are the module's own parameters), PEFT's adapter name, how many PEFT wrappers
        stood around the module (`depth`: its weights are `base_layer.`×depth below its place
        in PEFT's names), and PEFT's switch: a tuner layer without weights, which
        `disable_adapter()` / `enable_adapter_layers()` turn off and on."""

        def __init__(self, adapter_name, adapters, depth, enabled):
            nn.Module.__init__(self)
            self.adapter_name, self.adapters, self.depth = adapter_name, adapters, depth
            self._active_adapter = adapter_name
            self._disable_adapters = not enabled

        def active(self, weight):
            """The adapter on `weight` when it applies now (enabled and the active adapter), else None."""
            if self.disable_adapters or self.adapter_name not in self.active_adapters:
                return None
            return self.adapters.get(weight)

        def extra_repr(self):
            return f"adapter={self.adapter_name!r}, " + ", ".join(
                f"{w}: r={a.rank}, scaling={a.scaling:g}" for w, a in self.adapters.items())

    return ExpertLoRA


def expert_lora(module):
    """The `ExpertLoRA` of an experts module, or None when it has no adapters."""
    lora = getattr(module, "lora", None)
    return lora if peft_classes() is not None and isinstance(lora, _expert_lora_class()) else None


def _chain(outer, param_wrapper):
    chain = [outer]
    while isinstance(chain[-1].base_layer, param_wrapper):
        chain.append(chain[-1].base_layer)
    return chain


def _adopt(name, outer, param_wrapper):
    """The experts module inside the wrapper chain `outer` (at `name`), carrying its adapters."""
    chain = _chain(outer, param_wrapper)
    experts = chain[-1].base_layer
    adapters, names = {}, set()
    for depth, wrapper in enumerate(chain):
        where, weight = f"{name}{'.base_layer' * depth}", wrapper.parameter_name
        held = list(wrapper.lora_A.keys())
        if len(held) != 1:
            raise ValueError(f"fsdpturbo: the PEFT wrapper {where} of expert weight {weight!r} holds the LoRA adapters "
                             f"{held}; expert LoRA takes one adapter per expert weight")
        if wrapper.merged:
            raise ValueError(f"fsdpturbo: the LoRA adapter of expert weight {where}.{weight} is merged into the weight; "
                             f"unmerge it (model.unmerge_adapter()) before sharding")
        param = getattr(experts, weight)
        if weight not in ADAPTED_WEIGHTS or param.dim() != 3:
            raise ValueError(f"fsdpturbo: PEFT targets {where}.{weight} {tuple(param.shape)}; expert LoRA adapts the 3-D "
                             f"expert weights {list(ADAPTED_WEIGHTS)}")
        adapter = held[0]
        names.add(adapter)
        lora_a, lora_b = wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight
        down, up = engine_factors(lora_a, lora_b, param.size(0))
        experts.register_parameter(down_name(weight), nn.Parameter(down, requires_grad=lora_b.requires_grad))
        experts.register_parameter(up_name(weight), nn.Parameter(up, requires_grad=lora_a.requires_grad))
        adapters[weight] = Adapter(rank=int(wrapper.r[adapter]), scaling=float(wrapper.scaling[adapter]),
                                   peft_path=".base_layer" * depth)
    if len(names) != 1:
        raise ValueError(f"fsdpturbo: the expert weights of {name} carry different LoRA adapters {sorted(names)}; "
                         f"expert LoRA takes one adapter for all of them")
    adapter = names.pop()
    enabled = not outer.disable_adapters and adapter in outer.active_adapters
    experts.lora = _expert_lora_class()(adapter, adapters, len(chain), enabled)
    return experts


def take_over(model):
    """Replaces each chain of PEFT `ParamWrapper`s around an experts module of `model` (a PEFT
    model or the model inside one) by the experts module itself, carrying the chain's adapters
    in the engine's layout and an `ExpertLoRA`. Returns the names taken over ([] without PEFT
    wrappers, e.g. the second time)."""
    peft = peft_classes()
    if peft is None:
        return []
    param_wrapper = peft.ParamWrapper
    wrappers = {name: m for name, m in model.named_modules() if isinstance(m, param_wrapper)}
    taken = []
    for name, outer in wrappers.items():
        parent_name, _, leaf = name.rpartition(".")
        if parent_name in wrappers:  # an inner wrapper of a chain
            continue
        setattr(model.get_submodule(parent_name), leaf, _adopt(name, outer, param_wrapper))
        taken.append(name)
    if taken:
        _guard_peft_save(peft.PeftModel)
    return taken


def peft_save_pretrained(model, *args, **kwargs):
    """PEFT's own `PeftModel.save_pretrained`, past `_guard_peft_save`."""
    save = type(model).save_pretrained
    return (save.__wrapped__ if getattr(save, "fsdpturbo_guard", False) else save)(model, *args, **kwargs)


def _guard_peft_save(peft_model_class):
    """Makes PEFT's `save_pretrained` (process-wide, once) save the expert adapters of a PEFT
    model whose experts were taken over, or refuse, never leave them out: PEFT's own selection
    does not know the factors' names after `take_over`, so it would write the adapter without
    them and say nothing (whoever calls it: a user, LlamaFactory's save, which shards only the
    model inside the PEFT model). Given a full `state_dict` by the model's parameter names (as
    `get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))` returns it),
    the expert tensors are renamed and laid out as PEFT's first; without one it raises (each
    rank holds shards only: `fsdpturbo.save_lora_adapter` gathers them, collectively). Other
    PEFT models save as PEFT saves them."""
    original = peft_model_class.save_pretrained
    if getattr(original, "fsdpturbo_guard", False):
        return

    @functools.wraps(original)
    def save_pretrained(self, save_directory, *args, state_dict=None, **kwargs):
        if not any(expert_lora(m) is not None for m in self.modules()):
            return original(self, save_directory, *args, state_dict=state_dict, **kwargs)
        if state_dict is None:
            raise RuntimeError("save_pretrained of a PEFT model whose expert adapters fsdpturbo took over needs the "
                               "full state_dict by the model's parameter names (PEFT's own selection would leave the "
                               "expert adapters out); call fsdpturbo.save_lora_adapter(model, path) on every rank, "
                               "or pass state_dict=get_model_state_dict(model, "
                               "options=StateDictOptions(full_state_dict=True))")
        return original(self, save_directory, *args, state_dict=to_peft(self, state_dict), **kwargs)

    save_pretrained.fsdpturbo_guard = True
    peft_model_class.save_pretrained = save_pretrained


def inner_model(model):
    """The model inside a PEFT model (`get_base_model()`); any other model itself."""
    peft = peft_classes()
    return model.get_base_model() if peft is not None and isinstance(model, peft.PeftModel) else model


def _same(tensor):
    return tensor


@dataclasses.dataclass(frozen=True)
class PeftName:
    """A parameter's name in the PEFT model before `take_over`, and its layout there: the full
    tensor in PEFT's layout (`to_peft`) and back (`from_peft`)."""
    name: str
    to_peft: Callable = _same
    from_peft: Callable = _same


def peft_names(model):
    """{name in `model`: `PeftName`} for the parameters of the expert modules with adapters in
    `model`; `model`'s other parameters have PEFT's names and layout already. PEFT's parameter
    names hold the adapter name (`….lora_A.default.weight`); its files drop it."""
    out = {}
    for prefix, module in model.named_modules():
        lora = expert_lora(module)
        if lora is None:
            continue
        base = f"{prefix}{'.base_layer' * lora.depth}"
        factors = {n for weight in lora.adapters for n in (down_name(weight), up_name(weight))}
        for name, _ in module.named_parameters(recurse=False):
            if name not in factors:
                out[f"{prefix}.{name}"] = PeftName(f"{base}.{name}")
        for weight, adapter in lora.adapters.items():
            wrapper, experts = f"{prefix}{adapter.peft_path}", getattr(module, weight).size(0)
            out[f"{prefix}.{up_name(weight)}"] = PeftName(f"{wrapper}.lora_A.{lora.adapter_name}.weight", peft_lora_a,
                                                          functools.partial(engine_up, num_experts=experts))
            out[f"{prefix}.{down_name(weight)}"] = PeftName(f"{wrapper}.lora_B.{lora.adapter_name}.weight",
                                                            peft_lora_b,
                                                            functools.partial(engine_down, num_experts=experts))
    return out


def to_peft(model, tensors):
    """`tensors` (full tensors by the names of `model`'s parameters) by the names and in the
    layout of the PEFT model `model` came from (`peft_names`)."""
    names = peft_names(model)
    out = {}
    for name, tensor in tensors.items():
        peft = names.get(name, PeftName(name))
        out[peft.name] = peft.to_peft(tensor)
    return out
