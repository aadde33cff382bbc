"""FSDPTurbo's configuration, `fsdp_turbo.fsdp_turbo_config`: the dataclasses verl's
`fsdp_turbo` engine and the ms-swift fork build, `_dict_to_dataclass` (verl's path from a
plain dict), and what `FSDPTurboConfig.__post_init__` derives and checks.

`FSDPTurbo` reads only `distributed`, `memory`, `quantization` and `module_patches`; the model,
optimizer, data, run and checkpoint sections are plain data for a trainer (FSDPTurbo's own
`BaseTrainer` is not built). `EPPlanConfig` is the engine's own; `FSDPPlanConfig` extends the
engine's with the fields only the standalone API has (LlamaFactory's plugin imports both from
here).

Problems are reported by `fsdp_turbo.config_check`: every one at once, each naming its field's
path and what is accepted; `__post_init__` checks what needs no world size, `FSDPTurbo` checks
again at wrap time (consumers change fields after construction) with the world size.
"""
import dataclasses
import logging
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from fsdpturbo.efsdp import FSDPPlanConfig as _EngineFSDPPlanConfig
from fsdpturbo.ep import EPPlanConfig

from . import config_check

logger = logging.getLogger(__name__)

__all__ = ["CheckpointConfig", "CPPlanConfig", "DataConfig", "DistributedConfig", "EPPlanConfig", "FSDPPlanConfig",
           "FSDPTurboConfig", "MemoryConfig", "ModelConfig", "OptimizerConfig", "ProfileConfig", "QuantizationConfig",
           "TPPlanConfig", "TrainRunConfig"]


@dataclass
class ModelConfig:
    model_name_or_path: str = ""
    tokenizer_name_or_path: str = ""
    torch_dtype: torch.dtype = torch.bfloat16


@dataclass
class OptimizerConfig:
    optimizer_type: str = "AdamW"
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    lr: float = 1e-4
    warmup_ratio: float = 0.0
    lr_scheduler_type: str = "cosine"
    min_lr: float = 0.0
    clip_grad: float = 1.0
    clip_grad_norm_type: float = 2.0


@dataclass
class DataConfig:
    dataset_path: str = ""
    dataset_config: Optional[str] = None
    text_column: str = "text"
    split: str = "train"
    batch_size: int = 1
    max_seq_length: int = 4096
    num_workers: int = 0
    pin_memory: bool = True
    shuffle: bool = True


@dataclass
class ProfileConfig:
    enabled: bool = False


@dataclass
class TrainRunConfig:
    seed: int = 42
    max_steps: int = -1
    num_train_epochs: int = 1
    gradient_accumulation_steps: int = 1
    logging_steps: int = 1
    deterministic: bool = False
    profile: ProfileConfig = field(default_factory=ProfileConfig)


@dataclass
class CheckpointConfig:
    output_dir: str = "./output"
    resume_from_checkpoint: Optional[str] = None
    save_steps: int = 500
    strict: bool = True
    save_optim: bool = True
    load_optim: bool = True


@dataclass
class FSDPPlanConfig(_EngineFSDPPlanConfig):
    """The outer FSDP2's plan: the engine's fields (dtypes, prefetch counts, offload, hook
    modules, implementation) and the standalone API's. `apply_modules`: module pattern ->
    `fully_shard` keyword arguments (`{}`: the plan's); the root is always wrapped.
    `ignored_params`: parameter names kept whole on every rank, outside FSDP2."""
    param_init_fn: Optional[Callable] = None
    reshard_after_forward: bool = True
    ignored_params: List[str] = field(default_factory=list)


@dataclass
class TPPlanConfig:
    colwise_parallel: List[str] = None
    rowwise_parallel: List[str] = None
    sequence_parallel: List[str] = None

    def __post_init__(self):
        for name in ("colwise_parallel", "rowwise_parallel", "sequence_parallel"):
            if getattr(self, name) is None:
                setattr(self, name, [])


@dataclass
class CPPlanConfig:
    """Each entry: `{"target_functions": [dotted paths], "type": str}`."""
    ulysses_function_patches: List[dict] = field(default_factory=list)
    loss_function_patches: List[dict] = field(default_factory=list)


@dataclass
class DistributedConfig:
    """Sizes: the dense parameters are HSDP over (data_parallel_size = world / (fsdp · tp),
    fully_shard_parallel_size); the experts over (expert_data_parallel_size = world / (ep ·
    efsdp), expert_fully_shard_parallel_size, expert_parallel_size). The two derived sizes may
    be given; they must then equal what they derive to."""
    data_parallel_size: Optional[int] = None
    fully_shard_parallel_size: int = 1
    fsdp_plan: FSDPPlanConfig = None
    tensor_parallel_size: int = 1
    tp_plan: TPPlanConfig = None
    ulysses_parallel_size: int = 1
    cp_plan: CPPlanConfig = None
    expert_parallel_size: int = 1
    expert_fully_shard_parallel_size: int = 1
    expert_data_parallel_size: Optional[int] = None
    ep_plan: EPPlanConfig = None

    def __post_init__(self):
        self.fsdp_plan = self.fsdp_plan if self.fsdp_plan is not None else FSDPPlanConfig()
        self.tp_plan = self.tp_plan if self.tp_plan is not None else TPPlanConfig()
        self.cp_plan = self.cp_plan if self.cp_plan is not None else CPPlanConfig()
        self.ep_plan = self.ep_plan if self.ep_plan is not None else EPPlanConfig(apply_modules=[], dispatcher="eager")


@dataclass
class MemoryConfig:
    recompute: bool = False
    recompute_plan: List[str] = None
    chunk_batch: bool = False
    chunk_batch_plan: Any = None

    def __post_init__(self):
        if self.recompute_plan is None:
            self.recompute_plan = []


@dataclass
class QuantizationConfig:
    quantization_plan: Any = None


@dataclass
class FSDPTurboConfig:
    """`module_patches`: `{"target": dotted path, "replacement": callable or dotted path}`
    entries, applied by `FSDPTurbo` before expert parallelism."""
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: TrainRunConfig = field(default_factory=TrainRunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    module_patches: List[dict] = field(default_factory=list)

    def __post_init__(self):
        self.distributed = self.distributed if self.distributed is not None else DistributedConfig()
        self.memory = self.memory if self.memory is not None else MemoryConfig()
        _derive_ep(self.distributed)
        config_check.check(self)


def _derive_ep(distributed):
    """The original's EP derivations: dispatcher None means eager; EFSDP units default to the
    parents of the `.experts` patterns; with fsdp > 1 and ep > 1 the expert patterns join the
    outer FSDP2's ignored modules."""
    plan = distributed.ep_plan
    plan.apply_modules = [] if plan.apply_modules is None else plan.apply_modules
    plan.dispatcher = "eager" if plan.dispatcher is None else plan.dispatcher
    if plan.apply_efsdp_modules is None and isinstance(plan.apply_modules, list):
        plan.apply_efsdp_modules = [m.removesuffix(".experts") for m in plan.apply_modules
                                    if isinstance(m, str) and m.endswith(".experts")]
    fsdp_plan = distributed.fsdp_plan
    if distributed.fully_shard_parallel_size != 1 and distributed.expert_parallel_size != 1 \
            and isinstance(fsdp_plan.ignored_modules, list) and isinstance(plan.apply_modules, list):
        fsdp_plan.ignored_modules = list(dict.fromkeys(fsdp_plan.ignored_modules + plan.apply_modules))


# ---------------------------------------------------------------------------------------------
# From a plain dict
# ---------------------------------------------------------------------------------------------

def _dict_to_dataclass(cls, data):
    """`cls` built from `data` (a dict or any Mapping, e.g. an OmegaConf DictConfig): an unknown
    key logs a warning and is skipped; a mapping for a dataclass field (also Optional) recurses;
    lists keep their mappings as plain dicts; a string for an int, float or torch.dtype field is
    converted (when it cannot be, it is kept and a warning says so). Every level is built with
    its constructor, so each `__post_init__` runs. None gives None; anything else not a Mapping
    is returned as is."""
    return _build(cls, data, cls.__name__)


def _build(cls, data, path):
    if data is None or not isinstance(data, Mapping):
        return data
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            logger.warning("fsdp_turbo: %s has no field %r (its fields: %s); skipped", path, key, ", ".join(names))
            continue
        nested = _dataclass_of(hints[key])
        if nested is not None and isinstance(value, Mapping):
            kwargs[key] = _build(nested, value, f"{path}.{key}")
        else:
            kwargs[key] = _coerce_value(hints[key], _plain(value), f"{path}.{key}")
    return cls(**kwargs)


def _without_optional(hint):
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


def _dataclass_of(hint):
    hint = _without_optional(hint)
    return hint if dataclasses.is_dataclass(hint) else None


def _plain(value):
    """Mappings as dicts and sequences as lists, recursively (an OmegaConf container included)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [_plain(v) for v in value]
    return value


def _to_dtype(text):
    dtype = getattr(torch, text.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(text)
    return dtype


_CONVERTERS: Dict[Any, Callable[[str], Any]] = {int: int, float: float, torch.dtype: _to_dtype}


def _coerce_value(hint, value, path):
    convert = _CONVERTERS.get(_without_optional(hint))
    if convert is None or not isinstance(value, str):
        return value
    try:
        return convert(value)
    except ValueError:
        logger.warning("fsdp_turbo: %s is %r, which is not a %s; kept as a string", path, value,
                       getattr(_without_optional(hint), "__name__", hint))
        return value
