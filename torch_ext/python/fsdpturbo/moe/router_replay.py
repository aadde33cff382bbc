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

With an expert bias (`fsdpturbo.moe.expert_bias`) the router's own ids are its biased selection, and
the ids a training forward takes (recorded, replayed or its own) go to the experts, whose
counts the bias update reads.

A router's state is part of its EP module's (`fsdpturbo.moe.ep_state.RouterState`).
"""
import collections
import contextlib
import types
import weakref

import torch

from . import expert_bias
from .ep_state import RouterState, attach_router, ep_modules, router_state, state
from .recompute import in_recomputation

__all__ = ["install", "record_routes", "replay_routes"]

# Router classes whose selection is softmax → top-k (→ renormalised when this says so).
_NORMALISES = {"Qwen3MoeTopKRouter": lambda router: bool(router.norm_topk_prob),
               "Qwen3_5MoeTopKRouter": lambda router: True}


def _scores(router, logits, indices):
    """The router's scores of `indices` from its `logits`, as its own forward computes them."""
    top = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, indices)
    if _NORMALISES[type(router).__name__](router):
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype)


def _next_replayed(routes, logits):
    if not routes.replaying:
        raise ValueError(f"fsdpturbo.replay_routes: {routes.name} has no recorded route left for this forward (the "
                         f"replayed forwards outnumber the recorded ones)")
    indices = routes.replaying.popleft().to(logits.device)
    top_k = routes.module.top_k
    if indices.shape != (logits.size(0), top_k):
        raise ValueError(f"fsdpturbo.replay_routes: {routes.name} recorded routes of shape {list(indices.shape)}, "
                         f"this forward has {logits.size(0)} tokens × top-{top_k}: routes of another batch")
    return indices


def _taken(router, logits, scores, indices, taken):
    """The scores of the ids `taken`: the router's own where its ids agree (row by row), else
    computed from its logits. No host sync; the same operations whatever `taken` is."""
    same = (indices == taken).all(dim=-1, keepdim=True)
    return torch.where(same, scores, _scores(router, logits, taken))


def _own_routes(routes, hidden_states):
    """The router's result; with an expert bias (`fsdpturbo.moe.expert_bias`) its top-k is taken
    over the biased probabilities and the scores are its own of those ids."""
    logits, scores, indices = routes.original(hidden_states)
    bias = expert_bias.bias_of(routes)
    if bias is None:
        return logits, scores, indices
    indices = expert_bias.select(routes.module, logits, bias)
    return logits, _scores(routes.module, logits, indices), indices


def _routed_forward(router, hidden_states):
    """The router's forward, taking the first forward's ids in a recomputation and the replayed
    ids under `replay_routes`. A checkpointed layer's first forward and its recomputation run
    the same operations (checkpointing requires the recomputation to save what the first
    forward saved); a forward that is neither returns the router's own result untouched."""
    routes = router_state(router)
    logits, scores, indices = _own_routes(routes, hidden_states)
    if in_recomputation():
        if not routes.pending:  # a recomputation nothing was recorded for (reentrant checkpointing)
            return logits, scores, indices
        taken = routes.pending.pop()
        return logits, _taken(router, logits, scores, indices, taken), taken
    taken = _next_replayed(routes, logits) if routes.replaying is not None else indices
    if routes.recording is not None:
        routes.recording.append(taken.detach().clone())
    # A compiled backward recomputes inside its own graph, without running this: nothing to keep.
    if not torch.compiler.is_compiling() and torch.is_grad_enabled() and routes.checkpointed():
        routes.pending.append(taken.detach())
    elif taken is indices:
        return logits, scores, indices
    return logits, _taken(router, logits, scores, indices, taken), taken


def install(model, ep_module_names, layers):
    """Gives the router (`<block>.gate`, beside `<block>.experts`) of every EP module in
    `ep_module_names` the recorded routes, as the router of the module's state; `layers`: the
    decoder layers checkpointing wraps. Routers of other types are left alone (returned by
    name)."""
    modules = dict(model.named_modules())
    skipped = []
    for name in ep_module_names:
        ep_state = state(modules[name])
        block = name.rpartition(".")[0]
        router_name = f"{block}.gate" if block else "gate"
        router = modules.get(router_name)
        if router is None or type(router).__name__ not in _NORMALISES:
            skipped.append(name)
            continue
        if router_state(router) is not None:  # wrapped already
            attach_router(ep_state, router_state(router))
            continue
        layer = next((layer for layer in layers if any(m is router for m in layer.modules())), None)
        attach_router(ep_state, RouterState(module=router, name=router_name, original=router.forward,
                                             layer=weakref.ref(layer) if layer is not None else None))
        router.forward = types.MethodType(_routed_forward, router)
    return skipped


def _routers(model):
    """{router name: RouterState} of the EP modules of `model` that have a router."""
    routers = {s.router.name: s.router for s in (state(m) for _, m in ep_modules(model)) if s.router is not None}
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
        router.recording = routes[name]
    try:
        yield routes
    finally:
        for router in routers.values():
            router.recording = None


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
        router.replaying = collections.deque(routes[name])
    try:
        yield
    finally:
        for router in routers.values():
            router.replaying = None
