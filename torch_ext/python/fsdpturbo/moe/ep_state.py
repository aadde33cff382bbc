"""The state expert parallelism keeps on an expert module, in one object (`EPModuleState`, at
`module._fsdpturbo_ep`, as FSDP2 keeps `fully_shard.state(module)`): `state(module)` reads it,
`ep_modules(model)` finds the modules that have one. The router beside an expert module keeps
its part of that state (`RouterState`, `router_state(router)`).

`expert_parallelize_modules` also gives each such module the attributes the seed sets and
consumers read (`num_global_experts`, `num_local_experts`, `local_expert_indices`,
`expert_ids_per_ep_rank`) as read-only views of its state: it moves the module into a subclass
of its class, with the same name, that adds them as properties (FSDP2 moves a module into its
`FSDP<class>` the same way). Nothing here holds a tensor made at EP time (meta initialisation
materialises the module later) or registers a buffer.
"""
import collections
import dataclasses
import weakref
from typing import Callable, Optional

import torch

_ATTRIBUTE = "_fsdpturbo_ep"
_ROUTER_ATTRIBUTE = "_fsdpturbo_router"


@dataclasses.dataclass
class Tally:
    """The routes an EP module counted (`fsdpturbo.moe.expert_stats.record`): one int64 tensor
    [3, E] on the device, made at the first count, a row per window: every forward's (`routed`)
    and the slots the capacity-bounded dispatch dropped of them (`dropped`), read by
    `expert_load`; the training forwards' (grad enabled: `trained`), read by
    `update_expert_bias`. Each reader resets the rows it reads."""
    WINDOWS = ("routed", "dropped", "trained")
    counts: Optional[torch.Tensor] = None

    def window(self, name):
        """The counts [E] of window `name` (a view of its row), None before the first count."""
        return None if self.counts is None else self.counts[self.WINDOWS.index(name)]


@dataclasses.dataclass
class RouterState:
    """The router beside an EP module (`<block>.gate`, Qwen3 / Qwen3.5 MoE), whose routes stay
    put (fsdpturbo.moe.router_replay): its own forward, the decoder layer activation checkpointing
    wraps, the ids awaiting recomputation, what `record_routes` / `replay_routes` record and
    replay, and the expert-bias update rate (fsdpturbo.moe.expert_bias; None: no bias)."""
    module: torch.nn.Module
    name: str
    original: Callable
    layer: Optional[weakref.ref]
    pending: collections.deque = dataclasses.field(default_factory=collections.deque)
    recording: Optional[list] = None
    replaying: Optional[collections.deque] = None
    bias_rate: Optional[float] = None

    def checkpointed(self):
        layer = self.layer() if self.layer is not None else None
        return bool(layer is not None and getattr(layer, "gradient_checkpointing", False) and layer.training)


@dataclasses.dataclass
class EPModuleState:
    """An expert module under expert parallelism: its name in the model, E and L, its ep rank, the
    bound dispatcher its forward runs, what the backward does to its weights' gradients while
    expert parallelism alone owns them (None once EFSDP does), its tally of routes, its router
    when it has one, and its LoRA adapters when it has them (its `ExpertLoRA` child,
    fsdpturbo.moe.expert_lora)."""
    name: str
    num_global_experts: int
    num_local_experts: int
    ep_rank: int
    dispatcher: Callable
    gradient_reduction: Optional[object]
    tally: Tally = dataclasses.field(default_factory=Tally)
    router: Optional[RouterState] = None
    lora: Optional[torch.nn.Module] = None


def state(module):
    """The `EPModuleState` of `module`, or None when expert parallelism has not prepared it."""
    return getattr(module, _ATTRIBUTE, None)


def router_state(router):
    """The `RouterState` of a router beside an EP module, or None."""
    return getattr(router, _ROUTER_ATTRIBUTE, None)


def attach_router(ep_state, routes):
    """Makes `routes` the router state of an EP module's state and of its router."""
    ep_state.router = routes
    setattr(routes.module, _ROUTER_ATTRIBUTE, routes)


def ep_modules(model):
    """[(name, module)] of the expert-parallel modules of `model`, in `named_modules()` order."""
    return [(name, m) for name, m in model.named_modules() if state(m) is not None]


class EPModule:
    """The seed's attributes of an expert-parallel module, read-only views of its state."""

    @property
    def num_global_experts(self):
        return state(self).num_global_experts

    @property
    def num_local_experts(self):
        return state(self).num_local_experts

    @property
    def local_expert_indices(self):
        ep_state = state(self)
        first = ep_state.ep_rank * ep_state.num_local_experts
        return list(range(first, first + ep_state.num_local_experts))

    @property
    def expert_ids_per_ep_rank(self):
        """Each global expert's local index on its rank: also with one local expert (the seed
        leaves it unset and crashes), and a list (no tensor made at EP time)."""
        ep_state = state(self)
        return [i % ep_state.num_local_experts for i in range(ep_state.num_global_experts)]


_EP_CLASSES = {}


def attach(module, ep_state):
    """Gives `module` its state and the seed's attributes (the module moves into a subclass of
    its class that has them)."""
    cls = type(module)
    if not issubclass(cls, EPModule):
        if cls not in _EP_CLASSES:
            _EP_CLASSES[cls] = type(cls.__name__, (EPModule, cls), {})
        module.__class__ = _EP_CLASSES[cls]
    setattr(module, _ATTRIBUTE, ep_state)
