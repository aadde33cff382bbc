"""Expert parallelism: `expert_parallelize_modules(model, ep_mesh, plan)` and the token
dispatchers (eager, fused, domino; mc2 on Ascend NPUs, fsdpturbo/mc2.py).

The seed's contract (reference/seed-semantics.md §4–§5), with DESIGN §4 fixes: expert ids
outside [0, E) are an error on every rank (no rank hangs), experts == ep works, and split
sizes reach the host synchronously before the all-to-all.
"""
import dataclasses
import functools
import types
from typing import Callable, List, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Shard

from .consistency import check_same_on_every_rank, model_structure
from .efsdp import gradient_divide_factor, replica_groups
from .pattern import match_modules

DISPATCHERS = ("eager", "fused", "mc2", "domino")


@dataclasses.dataclass
class EPPlanConfig:
    """The seed's `EPPlanConfig` (fields and defaults of fsdp_turbo_config.py)."""
    apply_modules: List[str] = None
    dispatcher: Union[str, Callable] = None
    fixed_router: bool = False
    apply_efsdp_modules: List[str] = None
    moonep_config: Optional[object] = None
    gradient_divide_factor: Optional[float] = None


def normalize_expert_args(top_k_index, top_k_weights):
    """The seed's argument normalisation: swapped arguments, full router probabilities [T, E]."""
    if torch.is_floating_point(top_k_index):
        top_k_index, top_k_weights = top_k_weights, top_k_index
    if top_k_weights.size() != top_k_index.size():
        top_k_weights = top_k_weights.gather(1, top_k_index)
    return top_k_index, top_k_weights


def fixed_router_for_debug(top_k_index, top_k_weights, num_experts):
    """The seed's debug router: token t, slot k → expert (t + k) % E with weight 1/K."""
    with torch.no_grad():
        if top_k_index.dim() == 1:
            index = torch.arange(top_k_index.numel(), device=top_k_index.device) % num_experts
        else:
            t = torch.arange(top_k_index.size(0), device=top_k_index.device).unsqueeze(1)
            k = torch.arange(top_k_index.size(1), device=top_k_index.device).unsqueeze(0)
            index = (t + k) % num_experts
        weights = torch.full_like(top_k_weights, 1.0 / top_k_index.size(-1))
    return index.to(top_k_index.dtype), weights


# ----------------------------------------------------------------------------------------------
# Weight sharding and module preparation
# ----------------------------------------------------------------------------------------------

def distribute_expert_weights(module, ep_mesh):
    """Every direct parameter of `module` becomes its `Shard(0)` slice on `ep_mesh`, as a new
    nn.Parameter holding a DTensor (the seed's `distribute_expert_weight`)."""
    ep_size, ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for name, param in list(module.named_parameters(recurse=False)):
        rows = param.size(0)
        if rows % ep_size:
            raise AssertionError(f"Number of experts({rows}) is not divisible by ep size({ep_size}).")
        local_rows = rows // ep_size
        local = param.detach()[ep_rank * local_rows:(ep_rank + 1) * local_rows].clone()
        dtensor = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
        setattr(module, name, torch.nn.Parameter(dtensor, requires_grad=param.requires_grad))


def get_dispatcher_fn(dispatcher, ep_group, fixed_router=False):
    """The forward for `dispatcher` (the seed's selection; a callable is bound to the group)."""
    if callable(dispatcher):
        return functools.partial(dispatcher, ep_group)
    if dispatcher == "eager":
        return functools.partial(_eager_forward, ep_group=ep_group, fixed_router=fixed_router)
    if dispatcher == "domino":
        return functools.partial(_domino_forward, ep_group=ep_group, fixed_router=fixed_router)
    if dispatcher == "fused":
        return functools.partial(_fused_forward, ep_group=ep_group, fixed_router=fixed_router)
    if dispatcher == "mc2":
        from . import mc2

        if not mc2.available():
            raise RuntimeError("The 'mc2' dispatcher runs only on Ascend NPUs (the MC2 operators "
                               "aclnnAlltoAllvGroupedMatMul / aclnnGroupedMatMulAlltoAllv); this host has no NPU. "
                               "Use 'eager', 'fused' or 'domino'.")
        mc2.check_ep_size(dist.get_world_size(ep_group))
        return functools.partial(mc2.mc2_forward, ep_group=ep_group, fixed_router=fixed_router)
    raise RuntimeError(f"Unsupported dispatcher {dispatcher}.")


@dataclasses.dataclass(frozen=True)
class GradientReduction:
    """What the backward does to an expert weight's gradient while expert parallelism alone
    owns it: SUM over `groups` (the ranks holding replicas of the same experts), then divide
    by `factor` (DESIGN §4.1)."""
    groups: tuple
    factor: float


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
    gradient (`module.ep_gradient_reduction`)."""
    weight = getattr(module, name)
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    reduction = getattr(module, "ep_gradient_reduction", None)
    if reduction is not None and local.requires_grad:
        local = _ReduceGradient.apply(local, reduction)
    return local


def expert_parallelize_modules(model, ep_mesh, plan):
    """Applies expert parallelism to every module matched by `plan.apply_modules` (seed §4.1):
    expert weights become `Shard(0)` DTensors on `ep_mesh`, the module gets `num_global_experts`,
    `num_local_experts`, `local_expert_indices` and `expert_ids_per_ep_rank`, and its forward is
    replaced by the dispatcher's. Returns `model`.

    Gradients are right with expert parallelism alone (the seed leaves them unreduced, so with
    efsdp = 1 they are dp× too large): each backward sums an expert weight's gradient over the
    other dims of `ep_mesh`'s root mesh (edp, expert_cp; efsdp too if it is > 1 and EFSDP is
    never applied) and divides it by `plan.gradient_divide_factor` (None: the world size).
    `expert_fully_shard_modules`, when it follows, takes that over (no double reduction)."""
    if plan.dispatcher == "moonep":
        raise NotImplementedError("The 'moonep' dispatcher is not implemented by fsdpturbo.")
    dispatcher = getattr(plan.dispatcher, "__qualname__", plan.dispatcher)
    check_same_on_every_rank({"ep size": ep_mesh.size(), "model structure": model_structure(model),
                              "EP plan": (plan.apply_modules, dispatcher, plan.fixed_router, plan.apply_efsdp_modules,
                                          plan.gradient_divide_factor)}, "expert_parallelize_modules")
    ep_group = ep_mesh.get_group()
    ep_size, ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
    forward = get_dispatcher_fn(plan.dispatcher, ep_group, fixed_router=plan.fixed_router)
    reduction = GradientReduction(tuple(replica_groups(ep_mesh)), gradient_divide_factor(plan))
    for _, module in match_modules(model, plan.apply_modules or [], "[Expert Parallel]", plan):
        num_experts = module.num_experts if hasattr(module, "num_experts") else len(module)
        if num_experts % ep_size:
            raise AssertionError(f"Number of experts({num_experts}) is not divisible by ep size({ep_size}).")
        local = num_experts // ep_size
        module.num_global_experts = num_experts
        module.num_local_experts = local
        module.local_expert_indices = [ep_rank * local + i for i in range(local)]
        # Also set when there is one local expert (the seed leaves it unset and crashes). A
        # list, not a tensor: nothing made at EP time may need materialising (meta init); the
        # forward builds its tensor on the tokens' device.
        module.expert_ids_per_ep_rank = [i % local for i in range(num_experts)]
        distribute_expert_weights(module, ep_mesh)
        module.ep_gradient_reduction = reduction
        module.forward = types.MethodType(forward, module)
    return model


# ----------------------------------------------------------------------------------------------
# Routing metadata
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Route:
    sorted_index: torch.Tensor          # stable sort of the flat expert ids (the seed's `sorted`)
    input_splits: List[int]             # rows I send to each ep rank
    output_splits: List[int]            # rows I receive from each ep rank
    tokens_per_local_expert: List[int]
    local_order: torch.Tensor           # receive order → local-expert-major (the second sort)


def _gathered_counts(flat_ids_per_slice, num_experts, ep_group, count=None):
    """Per-slice expert counts (`count(flat)`, default bincount), all-gathered over the EP group:
    [P, S, E + 1]. The extra column carries "this rank has out-of-range ids", so a bad rank fails
    everywhere instead of leaving the others waiting in the next collective."""
    rows = []
    for flat in flat_ids_per_slice:
        row = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
            row[num_experts] = 1
        else:
            row[:num_experts] = count(flat) if count else torch.bincount(flat.long(), minlength=num_experts)
        rows.append(row)
    local = torch.stack(rows)
    world = dist.get_world_size(ep_group)
    gathered = torch.empty((world * local.size(0), local.size(1)), dtype=local.dtype, device=local.device)
    dist.all_gather_into_tensor(gathered, local, group=ep_group)
    return gathered.view(world, local.size(0), local.size(1))


def _check_ids(flat, top_k, num_experts, gathered, ep_group):
    if int(gathered[..., num_experts].sum()) == 0:
        return
    bad = ((flat < 0) | (flat >= num_experts)).nonzero()
    if bad.numel():
        j = int(bad[0, 0])
        raise ValueError(f"expert id {int(flat[j])} at token {j // top_k}, slot {j % top_k} is outside "
                         f"[0, {num_experts}): top_k_index must hold expert ids of this layer")
    ranks = dist.get_process_group_ranks(ep_group)
    offenders = [ranks[s] for s in range(gathered.size(0)) if int(gathered[s, :, num_experts].sum())]
    raise ValueError(f"expert ids outside [0, {num_experts}) on rank(s) {offenders} of this EP group; "
                     f"every rank of the group stops")


def _route(flat, counts, module, ep_rank, ep_size):
    """Routing metadata for one slice from its ids and the gathered counts [P, E]."""
    local = module.num_local_experts
    mine = counts[:, ep_rank * local:(ep_rank + 1) * local]                      # [P, L]
    own = counts[ep_rank]
    input_splits = own.view(ep_size, local).sum(1).tolist()                     # synchronous host copy
    output_splits = mine.sum(1).tolist()
    tokens_per_local_expert = mine.sum(0).tolist()
    ids = torch.arange(module.num_global_experts, device=flat.device) % local  # expert_ids_per_ep_rank
    local_expert_of_row = torch.repeat_interleave(ids, mine.reshape(-1))
    return _Route(sorted_index=torch.argsort(flat, stable=True), input_splits=input_splits,
                  output_splits=output_splits, tokens_per_local_expert=tokens_per_local_expert,
                  local_order=torch.argsort(local_expert_of_row, stable=True))


def _inverse(permutation):
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return inverse


# ----------------------------------------------------------------------------------------------
# The pieces of a dispatch: permute, all-to-all, expert MLP, combine
# ----------------------------------------------------------------------------------------------

def _experts_mlp(module, x, tokens_per_local_expert):
    """The expert MLP on rows grouped by local expert (seed `experts_computation`)."""
    gate_up = expert_weight(module, "gate_up_proj")
    down = expert_weight(module, "down_proj")
    limit = getattr(module, "limit", None)
    outputs, start = [], 0
    # Every local expert runs, also on zero rows, so each gets a (zero) weight gradient and
    # the gradient reductions of every rank line up.
    for expert, rows in enumerate(tokens_per_local_expert):
        chunk = x[start:start + rows]
        start += rows
        gate, up = F.linear(chunk, gate_up[expert]).chunk(2, dim=-1)
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        outputs.append(F.linear(module.act_fn(gate) * up, down[expert]))
    return torch.cat(outputs)


def _all_to_all(x, output_splits, input_splits, ep_group):
    if dist.get_world_size(ep_group) == 1:
        return x
    return all_to_all_single_autograd(x, output_splits, input_splits, ep_group)


def _dispatch(hidden, route, top_k, ep_group):
    permuted = hidden.index_select(0, route.sorted_index // top_k)
    return _all_to_all(permuted, route.output_splits, route.input_splits, ep_group)


def _compute(module, received, route):
    grouped = received.index_select(0, route.local_order)
    out = _experts_mlp(module, grouped, route.tokens_per_local_expert)
    return out.index_select(0, _inverse(route.local_order))


def _combine(y, route, weights, tokens, top_k, ep_group):
    back = _all_to_all(y, route.input_splits, route.output_splits, ep_group)
    per_slot = back.index_select(0, _inverse(route.sorted_index)).view(tokens, top_k, back.size(-1))
    # Weighted sum over k in f32 (f64 for f64), rounded once: the fused kernel's arithmetic.
    acc = torch.float64 if back.dtype == torch.float64 else torch.float32
    return (per_slot.to(acc) * weights.unsqueeze(-1).to(acc)).sum(1).to(back.dtype)


def _prepare(module, hidden_states, top_k_index, top_k_weights, fixed_router):
    hidden = hidden_states.reshape(-1, hidden_states.size(-1))
    top_k_index, top_k_weights = normalize_expert_args(top_k_index, top_k_weights)
    top_k = top_k_index.size(-1) if top_k_index.dim() > 1 else 1
    top_k_index = top_k_index.reshape(hidden.size(0), top_k)
    top_k_weights = top_k_weights.reshape(hidden.size(0), top_k)
    if fixed_router:
        top_k_index, top_k_weights = fixed_router_for_debug(top_k_index, top_k_weights, module.num_global_experts)
    return hidden, top_k_index, top_k_weights


def _shaped_like(out, hidden_states):
    """`out` in the shape of `hidden_states`; not a view when the shapes already agree (FSDP2
    warns about a wrapped module returning a view: in-place ops on it would skip its hooks)."""
    return out if out.shape == hidden_states.shape else out.view(hidden_states.shape)


def _eager_forward(module, hidden_states, top_k_index, top_k_weights, *, ep_group, fixed_router=False):
    """The eager dispatcher: torch reference ops, all-to-all through c10d with autograd."""
    hidden, index, weights = _prepare(module, hidden_states, top_k_index, top_k_weights, fixed_router)
    tokens, top_k = index.shape
    ep_size, ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    flat = index.reshape(-1)
    counts = _gathered_counts([flat], module.num_global_experts, ep_group)
    _check_ids(flat, top_k, module.num_global_experts, counts, ep_group)
    route = _route(flat, counts[:, 0, :module.num_global_experts], module, ep_rank, ep_size)
    received = _dispatch(hidden, route, top_k, ep_group)
    y = _compute(module, received, route)
    out = _combine(y, route, weights, tokens, top_k, ep_group)
    return _shaped_like(out, hidden_states)


def _domino_forward(module, hidden_states, top_k_index, top_k_weights, *, ep_group, fixed_router=False):
    """The domino dispatcher: the tokens in two slices; the second slice's dispatch all-to-all is
    in flight (async c10d work: functional collectives wait only when their result is used) while
    the first slice's experts run. Results equal the eager dispatcher's."""
    hidden, index, weights = _prepare(module, hidden_states, top_k_index, top_k_weights, fixed_router)
    tokens, top_k = index.shape
    ep_size, ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    split = (tokens + 1) // 2
    slices = [(0, split), (split, tokens)]
    flats = [index[a:b].reshape(-1) for a, b in slices]
    counts = _gathered_counts(flats, module.num_global_experts, ep_group)
    _check_ids(index.reshape(-1), top_k, module.num_global_experts, counts, ep_group)
    routes = [_route(flats[i], counts[:, i, :module.num_global_experts], module, ep_rank, ep_size) for i in range(2)]
    received = [_dispatch(hidden[a:b], routes[i], top_k, ep_group) for i, (a, b) in enumerate(slices)]
    outputs = []
    for i, (a, b) in enumerate(slices):
        y = _compute(module, received[i], routes[i])
        outputs.append(_combine(y, routes[i], weights[a:b], b - a, top_k, ep_group))
    return _shaped_like(torch.cat(outputs), hidden_states)


def _grouped_experts(module, grouped, per_expert, tokens_per_local_expert):
    """The expert MLP as two grouped matmuls over rows grouped by local expert; the eager MLP
    when no local expert has a row, as the seed does."""
    from ._native import ops

    if sum(tokens_per_local_expert) == 0:
        return _experts_mlp(module, grouped, tokens_per_local_expert)
    gate_up, down = expert_weight(module, "gate_up_proj"), expert_weight(module, "down_proj")
    gate, up = ops.grouped_mm(grouped, per_expert, gate_up).chunk(2, dim=-1)
    limit = getattr(module, "limit", None)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return ops.grouped_mm((module.act_fn(gate) * up).contiguous(), per_expert, down)


def _fused_forward(module, hidden_states, top_k_index, top_k_weights, *, ep_group, fixed_router=False):
    """The fused dispatcher: routing, permutes and the experts' grouped GEMMs in the op library
    (`torch.ops.fsdpturbo`: host kernels on CPU; NVRTC-compiled kernels and cuBLAS /
    `torch._grouped_mm` on CUDA; aclnn token permute/unpermute and grouped matmul on Ascend NPUs,
    `_fused_npu`)."""
    from . import mc2
    from ._native import ops

    hidden, index, weights = _prepare(module, hidden_states, top_k_index, top_k_weights, fixed_router)
    if mc2.runs_npu_kernels(hidden):
        return _shaped_like(_fused_npu(module, hidden, index, weights, ep_group), hidden_states)
    tokens, top_k = index.shape
    num_experts = module.num_global_experts
    ep_size, ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    flat = index.reshape(-1)
    routed = {}

    def count(_flat):
        routed["counts"], routed["permutation"], routed["splits"] = ops.moe_route(index, num_experts, ep_size)
        return routed["counts"]

    gathered = _gathered_counts([flat], num_experts, ep_group, count)
    _check_ids(flat, top_k, num_experts, gathered, ep_group)
    per_expert, output_splits, local_order = ops.moe_receive(gathered[:, 0, :num_experts], ep_rank)
    input_splits, output_splits = routed["splits"].tolist(), output_splits.tolist()

    permuted = ops.moe_permute(hidden.contiguous(), routed["permutation"], top_k)
    received = _all_to_all(permuted, output_splits, input_splits, ep_group)
    grouped = ops.moe_permute(received, local_order, 1)
    out = _grouped_experts(module, grouped, per_expert, per_expert.tolist())
    y = ops.moe_unpermute(out, local_order, None, out.size(0), 1)
    back = _all_to_all(y, input_splits, output_splits, ep_group)
    result = ops.moe_unpermute(back.contiguous(), routed["permutation"], weights, tokens, top_k)
    return _shaped_like(result, hidden_states)


def _host_counts(index, module, ep_group):
    """The expert counts of every rank, all-gathered (ids checked) and copied to the host once:
    my rows per global expert, and the rows each rank sends to each of my local experts
    (source-major, [P·L])."""
    num_experts, local = module.num_global_experts, module.num_local_experts
    ep_rank = dist.get_rank(ep_group)
    flat = index.reshape(-1)
    gathered = _gathered_counts([flat], num_experts, ep_group)
    _check_ids(flat, index.size(1), num_experts, gathered, ep_group)
    counts = gathered[:, 0, :num_experts].tolist()
    return counts[ep_rank], [n for row in counts for n in row[ep_rank * local:(ep_rank + 1) * local]]


def _fused_npu(module, hidden, index, weights, ep_group):
    """The fused dispatcher with the NPU kernels (seed §5.2, NPU column): counts by bincount on
    the device (one host copy of the gathered counts), both permutes by expert id
    (`aclnnMoeTokenPermute`), both combines by slot rows (`aclnnMoeTokenUnpermute`)."""
    from ._native import ops

    local, ep_size = module.num_local_experts, dist.get_world_size(ep_group)
    sends, blocks = _host_counts(index, module, ep_group)
    input_splits = [sum(sends[p * local:(p + 1) * local]) for p in range(ep_size)]
    output_splits = [sum(blocks[p * local:(p + 1) * local]) for p in range(ep_size)]
    tokens_per_local_expert = [sum(blocks[j::local]) for j in range(local)]

    permuted, slot_rows = ops.moe_token_permute(hidden.contiguous(), index)
    received = _all_to_all(permuted, output_splits, input_splits, ep_group)
    device = hidden.device
    local_ids = torch.arange(local, device=device).repeat(ep_size).repeat_interleave(
        torch.tensor(blocks, device=device))
    grouped, local_rows = ops.moe_token_permute(received, local_ids)
    per_expert = torch.tensor(tokens_per_local_expert, dtype=torch.int64, device=device)
    out = _grouped_experts(module, grouped, per_expert, tokens_per_local_expert)
    y = ops.moe_token_unpermute(out, local_rows, None)
    back = _all_to_all(y, input_splits, output_splits, ep_group)
    return ops.moe_token_unpermute(back.contiguous(), slot_rows, weights)
