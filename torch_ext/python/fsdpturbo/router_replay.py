"""Routes that stay put: recompute under activation checkpointing, and replay for RL trainers.

Expert parallelism sizes its all-to-alls from the routes. If the forward that activation
checkpointing re-runs in backward picked other experts (nondeterministic kernels, a near tie),
the recomputed all-to-all would no longer match the first one. So the router of every EP module
records its top-k ids in the first forward of a checkpointed decoder layer (non-reentrant
checkpointing: the first forward runs with grad enabled) and the recomputation takes exactly
those ids: where the recomputed router picked the same ids its own scores are kept, where it
picked others the scores of the recorded ids are computed from its logits (no host sync; both
passes of a checkpointed layer pay one softmax and gather over [tokens, E] more per router).

`record_routes(model)` / `replay_routes(model, routes)` expose the same for RL trainers: record
the routes a forward took (e.g. at rollout) and make a later forward take them.

With an expert bias (`fsdpturbo.expert_bias`) the router's own ids are its biased selection, and
the ids a training forward takes (recorded, replayed or its own) are what the bias update counts.
"""
import collections
import contextlib
import types
import weakref

import torch

from . import expert_bias
from .recompute import in_recomputation

__all__ = ["install", "record_routes", "replay_routes"]

# Router classes whose selection is softmax → top-k (→ renormalised when this says so).
_NORMALISES = {"Qwen3MoeTopKRouter": lambda router: bool(router.norm_topk_prob),
               "Qwen3_5MoeTopKRouter": lambda router: True}


class _Routes:
    """A router's state: the ids awaiting recomputation, and the record/replay of the API."""

    def __init__(self, original, layer):
        self.original = original
        self.layer = weakref.ref(layer) if layer is not None else None
        self.pending = collections.deque()
        self.recording = None
        self.replaying = None

    def checkpointed(self):
        layer = self.layer() if self.layer is not None else None
        return bool(layer is not None and getattr(layer, "gradient_checkpointing", False) and layer.training)


def _scores(router, logits, indices):
    """The router's scores of `indices` from its `logits`, as its own forward computes them."""
    top = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, indices)
    if _NORMALISES[type(router).__name__](router):
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype)


def _next_replayed(router, name, logits):
    routes = router.ft_routes
    if not routes.replaying:
        raise ValueError(f"fsdpturbo.replay_routes: {name} has no recorded route left for this forward (the "
                         f"replayed forwards outnumber the recorded ones)")
    indices = routes.replaying.popleft().to(logits.device)
    if indices.shape != (logits.size(0), router.top_k):
        raise ValueError(f"fsdpturbo.replay_routes: {name} recorded routes of shape {list(indices.shape)}, this "
                         f"forward has {logits.size(0)} tokens × top-{router.top_k}: routes of another batch")
    return indices


def _taken(router, logits, scores, indices, taken):
    """The scores of the ids `taken`: the router's own where its ids agree (row by row), else
    computed from its logits. No host sync; the same operations whatever `taken` is."""
    same = (indices == taken).all(dim=-1, keepdim=True)
    return torch.where(same, scores, _scores(router, logits, taken))


def _own_routes(router, hidden_states):
    """The router's result; with an expert bias (`fsdpturbo.expert_bias`) its top-k is taken
    over the biased probabilities and the scores are its own of those ids."""
    logits, scores, indices = router.ft_routes.original(hidden_states)
    bias = expert_bias.bias_of(router)
    if bias is None:
        return logits, scores, indices
    indices = expert_bias.select(router, logits, bias)
    return logits, _scores(router, logits, indices), indices


def _routed_forward(self, hidden_states):
    """The router's forward, taking the first forward's ids in a recomputation and the replayed
    ids under `replay_routes`. A checkpointed layer's first forward and its recomputation run
    the same operations (checkpointing requires the recomputation to save what the first
    forward saved); a forward that is neither returns the router's own result untouched."""
    routes = self.ft_routes
    logits, scores, indices = _own_routes(self, hidden_states)
    if in_recomputation():
        if not routes.pending:  # a recomputation nothing was recorded for (reentrant checkpointing)
            return logits, scores, indices
        taken = routes.pending.pop()
        return logits, _taken(self, logits, scores, indices, taken), taken
    taken = _next_replayed(self, self.ft_name, logits) if routes.replaying is not None else indices
    if routes.recording is not None:
        routes.recording.append(taken.detach().clone())
    if expert_bias.BIAS in self._buffers:
        expert_bias.count(self, taken)
    # A compiled backward recomputes inside its own graph, without running this: nothing to keep.
    if not torch.compiler.is_compiling() and torch.is_grad_enabled() and routes.checkpointed():
        routes.pending.append(taken.detach())
    elif taken is indices:
        return logits, scores, indices
    return logits, _taken(self, logits, scores, indices, taken), taken


def install(model, ep_module_names, layers):
    """Gives the router (`<block>.gate`, beside `<block>.experts`) of every EP module in
    `ep_module_names` the recorded routes; `layers`: the decoder layers checkpointing wraps.
    Routers of other types are left alone (returned by name)."""
    modules = dict(model.named_modules())
    skipped = []
    for name in ep_module_names:
        block = name.rpartition(".")[0]
        router = modules.get(f"{block}.gate" if block else "gate")
        if router is None or type(router).__name__ not in _NORMALISES:
            skipped.append(name)
            continue
        if hasattr(router, "ft_routes"):
            continue
        layer = next((layer for layer in layers if any(m is router for m in layer.modules())), None)
        router.ft_routes = _Routes(router.forward, layer)
        router.ft_name = f"{block}.gate" if block else "gate"
        router.forward = types.MethodType(_routed_forward, router)
    return skipped


def _routers(model):
    routers = {name: m for name, m in model.named_modules() if hasattr(m, "ft_routes")}
    if not routers:
        raise ValueError("fsdpturbo: the model has no expert-parallel router with recorded routes (expert "
                         "parallelism installs them for the Qwen3 / Qwen3.5 MoE routers)")
    return routers


@contextlib.contextmanager
def record_routes(model):
    """Within this context every EP router records the top-k ids it takes, one [tokens, top_k]
    tensor per forward: yields {router name: [ids per forward]}, filled as forwards run."""
    routers = _routers(model)
    routes = {name: [] for name in routers}
    for name, router in routers.items():
        router.ft_routes.recording = routes[name]
    try:
        yield routes
    finally:
        for router in routers.values():
            router.ft_routes.recording = None


@contextlib.contextmanager
def replay_routes(model, routes):
    """Within this context every EP router takes the recorded ids of `routes` (from
    `record_routes` on a model with the same routers), one entry per forward in order, with
    scores from its own logits. Routes of other routers, another token count or too few
    forwards are a ValueError."""
    routers = _routers(model)
    if set(routes) != set(routers):
        raise ValueError(f"fsdpturbo.replay_routes: the routes are for {sorted(set(routes) - set(routers))[:4]}, "
                         f"this model's routers without routes: {sorted(set(routers) - set(routes))[:4]}")
    for name, router in routers.items():
        router.ft_routes.replaying = collections.deque(routes[name])
    try:
        yield
    finally:
        for router in routers.values():
            router.ft_routes.replaying = None
