"""The token dispatchers of expert parallelism, by name: eager, fused, mc2 and domino, each a
strategy in one common pipeline (fsdpturbo.moe.dispatch.pipeline: prepare → counts → route →
dispatch → expert compute → combine), eager and fused also in its capacity-bounded,
static-shape mode (fsdpturbo.moe.dispatch.capacity); the expert compute in
fsdpturbo.moe.dispatch.experts, the kernels it runs with (torch's or the op library's) in
fsdpturbo.moe.dispatch.kernels, and where kernels run (NPU, test double) in
fsdpturbo.moe.dispatch.device.

The seed's contract, with docs/design.md §4 fixes: expert ids
outside [0, E) are an error on every rank (no rank hangs), experts == ep works, and split
sizes reach the host synchronously before the all-to-all.
"""
import dataclasses
import types
from typing import Callable, Optional

from ..ep_state import state
from . import kernels, mc2
from .capacity import Capacity, CapacityStrategy, capacity_forward
from .eager import domino_forward, eager_forward
from .fused import fused_forward


@dataclasses.dataclass(frozen=True)
class Dispatcher:
    """A named dispatcher: `forward(module, hidden_states, top_k_index, top_k_weights, *,
    ep_group, fixed_router)`, `check(ep_group)`, what rules it out when it is bound (the host,
    the group size), the expert kernels of its capacity-bounded mode (None: it has none), and
    whether its expert compute applies LoRA adapters (fsdpturbo.moe.expert_lora)."""
    name: str
    forward: Callable
    check: Optional[Callable] = None
    capacity_kernels: Optional[object] = None
    lora: bool = True


DISPATCHERS = {d.name: d for d in (Dispatcher("eager", eager_forward, capacity_kernels=kernels.TORCH),
                                   Dispatcher("fused", fused_forward, capacity_kernels=kernels.OP_LIBRARY),
                                   # its first grouped matmul is fused with the all-to-all
                                   Dispatcher("mc2", mc2.mc2_forward, mc2.check_available),
                                   Dispatcher("domino", domino_forward))}
NOT_IMPLEMENTED = ("moonep",)  # accepted by the seed's configuration, not implemented here


def check_implemented(name):
    """Raises NotImplementedError for a dispatcher the seed names but fsdpturbo does not build."""
    if isinstance(name, str) and name in NOT_IMPLEMENTED:
        raise NotImplementedError(f"The {name!r} dispatcher is not implemented by fsdpturbo.")


def check_lora(dispatcher, module_name):
    """Raises for a dispatcher whose expert compute does not apply the LoRA adapters of expert
    module `module_name` (a user's callable)."""
    entry = DISPATCHERS.get(dispatcher) if isinstance(dispatcher, str) else None
    if entry is None or not entry.lora:
        applying = sorted(name for name, d in DISPATCHERS.items() if d.lora)
        raise ValueError(f"fsdpturbo: {module_name} has LoRA adapters on its experts, which the dispatcher "
                         f"{getattr(dispatcher, '__qualname__', dispatcher)!r} does not apply; expert LoRA runs with "
                         f"the dispatchers {applying}")


def lookup(name):
    """The dispatcher called `name`; an unknown name raises the seed's error with the accepted ones."""
    check_implemented(name)
    if not isinstance(name, str) or name not in DISPATCHERS:
        raise RuntimeError(f"Unsupported dispatcher {name}. Supported: {sorted(DISPATCHERS)}")
    return DISPATCHERS[name]


class BoundDispatcher:
    """A dispatcher's forward bound to an EP group (and its other keyword `options`):
    `(module, hidden_states, top_k_index, top_k_weights)`."""

    def __init__(self, forward, ep_group, fixed_router=False, **options):
        self.forward, self.ep_group, self.fixed_router, self.options = forward, ep_group, fixed_router, options

    def __call__(self, module, hidden_states, top_k_index, top_k_weights):
        return self.forward(module, hidden_states, top_k_index, top_k_weights, ep_group=self.ep_group,
                            fixed_router=self.fixed_router, **self.options)


class UserDispatcher:
    """A user's callable bound to the EP group as the seed does: `fn(ep_group, module,
    hidden_states, top_k_index, top_k_weights)`."""

    def __init__(self, fn, ep_group):
        self.fn, self.ep_group = fn, ep_group

    def __call__(self, module, hidden_states, top_k_index, top_k_weights):
        return self.fn(self.ep_group, module, hidden_states, top_k_index, top_k_weights)


def get_dispatcher_fn(dispatcher, ep_group, fixed_router=False, capacity=None):
    """The forward for `dispatcher` (a name, or a callable bound to the group, as the seed
    selects), as `forward(module, hidden_states, top_k_index, top_k_weights)`; with a
    `Capacity`, its capacity-bounded mode (eager and fused only)."""
    if capacity is not None:
        entry = DISPATCHERS.get(dispatcher) if isinstance(dispatcher, str) else None
        if entry is None or entry.capacity_kernels is None:
            bounded = sorted(name for name, d in DISPATCHERS.items() if d.capacity_kernels is not None)
            raise ValueError(f"fsdpturbo: the capacity-bounded dispatch runs with the dispatchers {bounded}, got "
                             f"{getattr(dispatcher, '__qualname__', dispatcher)!r}")
        return BoundDispatcher(capacity_forward, ep_group, fixed_router,
                               strategy=CapacityStrategy(capacity, entry.capacity_kernels))
    if callable(dispatcher):
        return UserDispatcher(dispatcher, ep_group)
    entry = lookup(dispatcher)
    if entry.check is not None:
        entry.check(ep_group)
    return BoundDispatcher(entry.forward, ep_group, fixed_router)


def moe_forward(self, hidden_states, top_k_index, top_k_weights):
    """The forward of an expert module under expert parallelism: the bound dispatcher of its
    state (`fsdpturbo.moe.ep_state`). A plain function bound with `types.MethodType`, so
    torch.compile traces it."""
    return state(self).dispatcher(self, hidden_states, top_k_index, top_k_weights)


def install(module):
    """Makes the dispatcher of its state (a `get_dispatcher_fn` result) the forward of expert
    module `module`."""
    module.forward = types.MethodType(moe_forward, module)


__all__ = ["BoundDispatcher", "Capacity", "DISPATCHERS", "Dispatcher", "NOT_IMPLEMENTED", "UserDispatcher",
           "check_implemented", "check_lora", "get_dispatcher_fn", "install", "lookup", "moe_forward"]
