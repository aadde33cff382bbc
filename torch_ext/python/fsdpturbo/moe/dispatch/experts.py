"""Expert compute: the local experts' MLP on rows already grouped by local expert, as a loop of
per-expert matmuls (the seed's `experts_computation`) or as two grouped matmuls (the op
library's `grouped_mm`), and the expert weights as the forward uses them (local slices whose
backward reduces the gradient while expert parallelism alone owns it), each with its LoRA
adapter when it has one (fsdpturbo.moe.expert_lora)."""
import dataclasses
import functools
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from .. import expert_lora
from ..._native import ops
from ..ep_state import state


@dataclasses.dataclass(frozen=True)
class GradientReduction:
    """What the backward does to an expert weight's gradient while expert parallelism alone
    owns it: SUM over `groups` (the ranks holding replicas of the same experts), then divide
    by `factor` (docs/design.md §4.1)."""
    groups: tuple
    factor: float

    @property
    def is_identity(self):
        """Nothing to reduce and nothing to divide (one rank, factor 1)."""
        return not self.groups and self.factor == 1


class _ReduceGradient(torch.autograd.Function):
    """Identity forward; the backward applies a `GradientReduction` to the incoming gradient.
    Linear, so it is right per micro-batch under gradient accumulation, and it runs once per
    use of the weight, also when activation checkpointing recomputes the forward."""

    @staticmethod
    def forward(ctx, weight, reduction):
        ctx.reduction = reduction
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        for group in ctx.reduction.groups:
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
        return grad.div_(ctx.reduction.factor), None


def expert_weight(module, name):
    """The local slice of expert weight `name` of an EP module, as the forward uses it. Until
    `expert_fully_shard_modules` takes the module over, its backward reduces and divides the
    gradient (its state's `gradient_reduction`), unless that is the identity."""
    weight = getattr(module, name)
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    reduction = state(module).gradient_reduction
    if reduction is not None and not reduction.is_identity and local.requires_grad:
        local = _ReduceGradient.apply(local, reduction)
    return local


@dataclasses.dataclass(frozen=True)
class ExpertProjection:
    """An expert weight as the forward applies it: the local slice [L, out, in] and, while a
    LoRA adapter on it applies, the adapter's local factors down [L, r, in] and up [L, out, r]
    and its scaling s."""
    weight: torch.Tensor
    lora: Optional[tuple] = None  # (down, up, scaling)

    def __call__(self, x, matmul, down_matmul=None, up_matmul=None):
        """The rows `x` through the projection: `matmul(x, w)` multiplies each row by its
        expert's w [L, ·, ·] transposed (the kernel's grouping of the rows), and the adapter
        adds s·(x·downᵀ)·upᵀ: two rank-r matmuls, no merged copy of the weight. The adapter's
        two take `down_matmul` and `up_matmul` where given (mc2: the one beside the all-to-all
        fused with it, the other the grouped matmul on the routed rows), else `matmul`."""
        out = matmul(x, self.weight)
        if self.lora is None:
            return out
        down, up, scaling = self.lora
        return out + (up_matmul or matmul)((down_matmul or matmul)(x, down) * scaling, up)


def _projection(module, name):
    lora = state(module).lora
    adapter = None if lora is None else lora.active(name)
    lora = None if adapter is None else (expert_weight(module, expert_lora.down_name(name)),
                                         expert_weight(module, expert_lora.up_name(name)), adapter.scaling)
    return ExpertProjection(expert_weight(module, name), lora)


def expert_projections(module):
    """The local (gate_up_proj, down_proj) as `ExpertProjection`s: [L, 2·I, H] and [L, H, I]."""
    return tuple(_projection(module, name) for name in expert_lora.ADAPTED_WEIGHTS)


def _expert_linear(x, weight, expert):
    """The rows `x` of one expert times its weight transposed."""
    return F.linear(x, weight[expert])


def grouped_linear(x, weight, counts):
    """The rows `x`, grouped by local expert (`counts` rows each), each times its expert's
    weight transposed: the op library's grouped matmul."""
    return ops.grouped_mm(x.contiguous(), counts, weight)


class _SiluGate(torch.autograd.Function):
    """silu(gate) · up from `gate_up` [rows, 2·I] (gate, then up): torch's own silu and
    silu_backward, with the backward writing both halves of one [rows, 2·I] gradient in place
    (no `cat` of the two halves)."""

    @staticmethod
    def forward(ctx, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        activated = F.silu(gate)
        ctx.save_for_backward(gate_up, activated)
        return activated * up

    @staticmethod
    def backward(ctx, grad):
        gate_up, activated = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        grad_gate_up = torch.empty_like(gate_up)
        grad_gate, grad_up = grad_gate_up.chunk(2, dim=-1)
        torch.mul(grad, activated, out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        return grad_gate_up


# The SiLU activation modules of torch and Hugging Face (`ACT2FN["silu"]`), by qualified name.
_SILU_MODULES = {"torch.nn.modules.activation.SiLU", "transformers.activations.SiLUActivation"}


def _is_silu(act_fn):
    kind = type(act_fn)
    return act_fn is F.silu or f"{kind.__module__}.{kind.__qualname__}" in _SILU_MODULES


def activation(module, gate_up):
    """act(gate) · up from the first matmul's output [rows, 2·I], with the module's `limit`
    clamp when it has one (gpt-oss style)."""
    limit = getattr(module, "limit", None)
    # Traced, the plain expression: inductor fuses it, and dynamo cannot trace `out=` into halves.
    if limit is None and _is_silu(module.act_fn) and gate_up.size(-1) % 2 == 0 and \
            not torch.compiler.is_compiling():
        return _SiluGate.apply(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return module.act_fn(gate) * up


def mlp_loop(module, x, tokens_per_local_expert):
    """The expert MLP on rows grouped by local expert, one expert at a time (seed
    `experts_computation`)."""
    gate_up, down = expert_projections(module)
    outputs, start = [], 0
    # Every local expert runs, also on zero rows, so each gets a (zero) weight gradient and
    # the gradient reductions of every rank line up.
    for expert, rows in enumerate(tokens_per_local_expert):
        chunk = x[start:start + rows]
        start += rows
        linear = functools.partial(_expert_linear, expert=expert)
        outputs.append(down(activation(module, gate_up(chunk, linear)), linear))
    return torch.cat(outputs)


def grouped_mlp(module, grouped, per_expert, tokens_per_local_expert):
    """The expert MLP as two grouped matmuls over rows grouped by local expert (`per_expert`
    rows each, a tensor; `tokens_per_local_expert` the same on the host); the loop when no
    local expert has a row, as the seed does."""
    if sum(tokens_per_local_expert) == 0:
        return mlp_loop(module, grouped, tokens_per_local_expert)
    gate_up, down = expert_projections(module)
    linear = functools.partial(grouped_linear, counts=per_expert)
    return down(activation(module, gate_up(grouped, linear)), linear)
