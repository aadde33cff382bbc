"""Aux-loss-free load balancing (DeepSeek-V3 §2.1.2): a per-expert bias on the routing scores
for top-k selection only.

With `dist_config.expert_bias_update_rate` u, `install` gives the router of every EP module
(Qwen3 / Qwen3.5 MoE) a persistent float32 buffer `expert_bias` [E], zero at first. The router
then picks its top-k experts by softmax probability + bias, while the weights of the chosen
experts stay its own probabilities (renormalised as the router does), so the bias steers
routes and never the output scale. Route replay under activation checkpointing takes the
recorded (biased) ids as it does any other.

Each training forward (grad enabled, not the recomputation activation checkpointing runs in
backward) counts the ids it took in its EP module's tally on the device (the tally
`fsdpturbo.expert_load` reads too: `fsdpturbo.moe.expert_stats`). `update_expert_bias(model)`,
called once per optimizer step, sums the training forwards' counts over every rank in one
all-reduce (the global tokens per expert of the step: all ranks, all micro-batches), moves each
bias by
u · sign(mean load − load_e) (an overloaded expert's bias goes down), resets those counts and
checks that the bias is identical on every rank. The bias is part of the model state, so
`save_checkpoint` / `load_checkpoint` (DCP, any layout) and the Hugging Face weight files carry
it.
"""
import torch
import torch.distributed as dist

from .ep_state import ep_modules, state
from .expert_stats import reduce_tallies

__all__ = ["install", "update_expert_bias"]

BIAS = "expert_bias"


def install(model, rate):
    """Registers the zero `expert_bias` buffer on the router of every EP module of `model`, and
    the update rate in its state (after expert parallelism, which wraps those routers). A model
    without EP routers, or with EP modules whose router type has no wrapper, is an error."""
    states = [state(m) for _, m in ep_modules(model)]
    routers = [s.router for s in states if s.router is not None]
    if not routers:
        raise ValueError("fsdpturbo: dist_config.expert_bias_update_rate needs expert parallelism (ep_size > 1): the "
                         "bias lives in the routers of the expert-parallel Qwen3 / Qwen3.5 MoE blocks")
    if len(routers) != len(states):
        raise NotImplementedError(f"fsdpturbo: dist_config.expert_bias_update_rate: {len(states)} EP modules, "
                                  f"{len(routers)} with a Qwen3 / Qwen3.5 router; the expert bias is built for those")
    for router in routers:
        device = router.module.weight.device
        router.module.register_buffer(BIAS, torch.zeros(router.module.num_experts, dtype=torch.float32,
                                                        device="cpu" if device.type == "meta" else device))
        router.bias_rate = float(rate)
    return model


def bias_of(router):
    """The expert bias of a router (its `RouterState`; None when it has none), checked: float32
    [E]."""
    if BIAS not in router.module._buffers:
        return None
    bias, experts = router.module._buffers[BIAS], router.module.num_experts
    if not isinstance(bias, torch.Tensor) or bias.shape != (experts,) or bias.dtype != torch.float32:
        what = f"shape {list(bias.shape)} and dtype {bias.dtype}" if isinstance(bias, torch.Tensor) else repr(bias)
        raise ValueError(f"fsdpturbo: {router.name}.{BIAS} has {what}; the router has {experts} experts: expected "
                         f"a float32 tensor of shape [{experts}]")
    return bias


def select(router, logits, bias):
    """The top-k ids by router probability + `bias`."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    return torch.topk(probs + bias, router.top_k, dim=-1).indices


def update_expert_bias(model, *, check=True, group=None):
    """Moves every router's expert bias by u · sign(mean load − load_e), the loads being the
    tokens per expert of the training forwards since the last update summed over every rank of
    `group` (default: the world), and resets those counts. Call it once per optimizer step (e.g.
    `optimizer.register_step_post_hook(lambda *_: fsdpturbo.update_expert_bias(model))`).
    `check`: one more all-reduce (max of bias and −bias) and a host sync, raising RuntimeError on
    every rank when the bias differs between ranks. Collective."""
    states = [s for s in (state(m) for _, m in ep_modules(model))
              if s.router is not None and BIAS in s.router.module._buffers]
    if not states:
        raise ValueError("fsdpturbo.update_expert_bias: the model has no expert bias (shard_model installs it with "
                         "dist_config.expert_bias_update_rate)")
    routers = [(s.router.name, s.router) for s in states]
    biases = [bias_of(router) for _, router in routers]
    sizes = [b.numel() for b in biases]
    loads = reduce_tallies([s.tally for s in states], ("trained",), sizes, biases[0].device, group=group)
    with torch.no_grad():
        for (_, router), bias, load in zip(routers, biases, loads.split(sizes)):
            load = load.float()
            bias.add_(torch.sign(load.mean() - load), alpha=router.bias_rate)
    if check:
        _check_identical(routers, biases, sizes, group)


def _check_identical(routers, biases, sizes, group):
    flat = torch.cat(biases)
    extremes = torch.cat([flat, -flat])
    if dist.is_initialized():
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    spread = extremes[:flat.numel()] + extremes[flat.numel():]  # max − min over ranks, per element
    if bool((spread != 0).any()):
        names = [name for (name, _), s in zip(routers, spread.split(sizes)) if bool((s != 0).any())]
        raise RuntimeError(f"fsdpturbo.update_expert_bias: the expert bias differs between ranks in {names[:4]}"
                           f"{' and more' if len(names) > 4 else ''} (max difference {spread.max().item():.3e}); "
                           f"every rank must hold the same bias (set or loaded on some ranks only?)")
