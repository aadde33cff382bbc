"""Placement-aware gradient norm and clipping across meshes (docs/design.md §4.2).

A model trained with FSDPTurbo holds gradients on several meshes at once: plain tensors
(replicated everywhere), FSDP2 DTensors on the dp mesh, expert DTensors on the ep mesh or on the
2-D (efsdp, ep) mesh, DTensors replicated across cp. torch's own `clip_grad_norm_` cannot stack
DTensors of different meshes, and the seed's hand-written version sums every local norm over
every group (effectively the whole world), which counts replicas several times
(docs/seed.md). Here every gradient's local p-power sum is reduced over exactly the mesh
dims on which it is sharded:

* **Reduction set.** For a DTensor gradient, the process groups of the mesh dims on which it is
  `Shard` (including `_StridedShard`); `Replicate` dims are counted once (not reduced), dims of
  size 1 need nothing, `Partial` gradients are first redistributed to `Replicate` on those dims
  (a collective over them). A plain tensor is replicated: its set is empty. A mesh dim is
  identified by the global ranks of this rank's process group on it, so the same group reached
  through different DeviceMesh objects (dp of the data mesh and dp of an FSDP2 sub-mesh) is one
  dim.
* **One collective per set.** Gradients are grouped by distinct set, in first-seen order over
  the *parameter* list (which every rank shares), never over the gradients that happen to be
  present: a rank whose `param.grad` is None contributes 0 but issues the same collectives in
  the same order, so no rank can hang. The grouping is the core's (`fsdpturbo_norm_plan`): each
  distinct mesh dim gets an id in first-seen order over the parameter list, the same on every
  rank. Each set's local Σ|g|^p (max |g| for p = inf) is computed with one fused call and
  reduced with one scalar all-reduce per mesh dim of the set (SUM, or MAX for p = inf, with NaN
  carried explicitly because backends' MAX may drop it), dims taken in ascending id order.
* **One coefficient.** `min(max_norm / (total + 1e-6), 1)` scales every local gradient (the
  local tensor of a DTensor, also a `Partial` one: scaling is linear). A non-finite total (nan
  or inf) leaves the gradients untouched and is returned, or raises with
  `error_if_nonfinite=True` (on every rank: every rank computes the same total).

Kernels. CPU and CUDA gradients of dtype float32/float64/float16/bfloat16 go through the op
library: `torch.ops.fsdpturbo.power_sum` (one fused multi-tensor pass per set and device, f64
accumulation; on CUDA the NVRTC-compiled kernels of libfsdpturbo) and
`torch.ops.fsdpturbo.foreach_scale_` (one fused in-place pass over all local gradients of a
device; the coefficient is read on the host once). Gradients on other devices (NPU until its
kernels land), and gradients of other dtypes, use torch's
`torch._foreach_norm` (float32 accumulation, float64 for float64 data) and `torch._foreach_mul_`
per (device, dtype) group; on those devices nothing synchronises with the host unless
`error_if_nonfinite=True` (as in torch). The all-reduced scalar lives on the device of the mesh
(`DeviceMesh.device_type`), in float64 (float32 on device types other than cpu and cuda).

Assumptions (what `Replicate` and "plain" mean): replicas hold equal gradients. Every rank must
pass the same parameters in the same order, and a gradient's reduction set must match its
parameter's (a `Shard` parameter with a non-`Shard` gradient on the same dim is a ValueError,
raised on every rank before any collective). A `Partial` gradient must exist on every rank of
its mesh (as autograd produces it): its redistribution is a collective, which a rank holding
None for it would not join.

Differences from torch's `clip_grad_norm_`: the returned 0-dim tensor is float32 (float64 when a
gradient is float64), on the device of the first parameter; gradients are not multiplied when
the coefficient is 1 or the total is non-finite; `max_norm` must be >= 0 (inf: never clip);
p = 0, negative and NaN orders are a ValueError.
"""
import ctypes
import logging
import math

import torch
import torch.distributed as dist
from torch import nn

from . import _native
from ._native import ops

logger = logging.getLogger(__name__)

__all__ = ["clip_grad_norm_", "get_total_norm", "warmup_grad_norm"]

_HOST_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

# Tests set this to run the torch fallback (`_foreach_norm` / `_foreach_mul_`, what CUDA and NPU
# gradients use) on CPU gradients: the CPU twin of the device path.
_FORCE_TORCH_KERNELS = False


_TYPES = []


def _dtensor_types():
    """(DTensor, Shard, _StridedShard, Replicate) or None on a torch without distributed."""
    if not _TYPES:
        try:
            from torch.distributed.tensor import DTensor
            from torch.distributed.tensor.placement_types import Replicate, Shard
        except ImportError:  # a torch built without distributed support: no DTensors exist
            _TYPES.append(None)
        else:
            try:
                from torch.distributed.tensor.placement_types import _StridedShard
            except ImportError:
                _StridedShard = Shard
            _TYPES.append((DTensor, Shard, _StridedShard, Replicate))
    return _TYPES[0]


def _check_norm_type(norm_type):
    p = float(norm_type)
    if p == math.inf or (math.isfinite(p) and p > 0):
        return p
    why = " (p = 0 counts non-zero entries, which is not a norm that can be clipped)" if p == 0 else ""
    raise ValueError(f"norm_type must be a finite p > 0 (a p-norm, e.g. 2.0) or inf (the max norm), "
                     f"got {p!r}{why}")


class _Dims:
    """Per-call numbering of mesh dims: (mesh, dim index) -> id, or None for a dim of size 1
    (nothing to reduce). A dim is keyed by the global ranks of this rank's group on it, and
    ids go to distinct keys in first-seen order; `by_id[id]` is (key, group, device type)."""

    def __init__(self):
        self._cache = {}
        self._ids = {}
        self.by_id = []

    def get(self, mesh, i):
        key = (id(mesh), i)
        if key not in self._cache:
            if mesh.size(i) == 1:
                self._cache[key] = None
            else:
                group = mesh.get_group(i)
                ranks = tuple(dist.get_process_group_ranks(group))
                if ranks not in self._ids:
                    self._ids[ranks] = len(self.by_id)
                    self.by_id.append((ranks, group, mesh.device_type))
                self._cache[key] = self._ids[ranks]
        return self._cache[key]


def _shard_dims(t, types, dims, name):
    """The ids (`_Dims`) of the mesh dims of size > 1 on which DTensor `t` is Shard or
    _StridedShard, in mesh order (Replicate and Partial dims are not reduced: Partial gradients
    are redistributed first); None when this rank is not part of `t`'s mesh."""
    mesh = t.device_mesh
    if mesh.get_coordinate() is None:
        return None
    _, Shard, StridedShard, _ = types
    out = []
    for i, placement in enumerate(t.placements):
        if isinstance(placement, (Shard, StridedShard)):
            dim = dims.get(mesh, i)
            if dim is not None:
                out.append(dim)
        elif not (placement.is_replicate() or placement.is_partial()):
            raise ValueError(f"{name}: unsupported placement {placement!r} on mesh dim {i}; accepted: Shard, "
                             f"_StridedShard, Replicate, Partial")
    return tuple(out)


def _entries(items, as_grads):
    """Normalises the argument into (name, parameter-or-None, gradient-or-None) triples: a module
    gives its parameters; a Parameter stands for its `.grad`; with `as_grads`, any other tensor is
    a gradient itself. Frozen parameters without a gradient are left out (on every rank)."""
    if isinstance(items, nn.Module):
        named = items.named_parameters()
    else:
        if isinstance(items, torch.Tensor):
            items = [items]
        named = ((f"parameters[{i}]", t) for i, t in enumerate(items))
    out = []
    for name, t in named:
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor or parameter, got {type(t).__name__}")
        if isinstance(t, nn.Parameter) or not as_grads:
            grad = t.grad
            if grad is None and not t.requires_grad:
                continue
            out.append((name, t, grad))
        else:
            out.append((name, None, t))
    return out


def _uses_host_kernels(t):
    return t.device.type in ("cpu", "cuda") and t.dtype in _HOST_DTYPES and not _FORCE_TORCH_KERNELS


def _by_device(tensors):
    groups = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return groups.values()


def _norm_plan(id_lists):
    """`fsdpturbo_norm_plan` over the entries' Shard dim ids: (set index per entry, the sets'
    ids in ascending order)."""
    n = len(id_lists)
    distinct = set(id_lists)
    most = max(map(len, distinct), default=0)
    roles = (ctypes.c_int32 * most)(*[_native.DIM_SHARD] * most)
    arrays, layouts = {}, {}
    for ids in distinct:
        arrays[ids] = (ctypes.c_uint32 * len(ids))(*ids)
        layouts[ids] = bytes(_native.GradT(dims=arrays[ids], roles=roles, n_dims=len(ids)))
    # The entries repeat a few layouts: joining their bytes is ~10x faster than setting fields
    # entry by entry (`arrays` and `roles` stay alive until the call returns).
    grads = (_native.GradT * n).from_buffer_copy(b"".join([layouts[ids] for ids in id_lists]))
    # Each set is one distinct layout's ids, sorted: the distinct layouts bound both outputs.
    sets_cap, dims_cap = len(layouts), sum(map(len, layouts))
    grad_set = (ctypes.c_size_t * n)()
    set_ends = (ctypes.c_size_t * sets_cap)()
    set_dims = (ctypes.c_uint32 * dims_cap)()
    n_sets, n_set_dims = ctypes.c_size_t(), ctypes.c_size_t()
    _native.check(_native.lib.fsdpturbo_norm_plan(grads, n, grad_set, set_ends, sets_cap, ctypes.byref(n_sets),
                                                  set_dims, dims_cap, ctypes.byref(n_set_dims)))
    flat = set_dims[:n_set_dims.value]
    ends = set_ends[:n_sets.value]
    return grad_set[:n], [flat[start:end] for start, end in zip([0] + ends[:-1], ends)]


class _Plan:
    """The gradients of one call, grouped by reduction set in first-seen order over the shared
    list. `sets`: [(dims, host locals, other locals)], dims as (key, group, device type);
    `host`/`other`: the tensors to scale."""

    def __init__(self):
        self.sets = []
        self.host = []
        self.other = []
        self.home = None
        self.f64 = False


def _prepare(items, as_grads):
    types = _dtensor_types()
    DTensor = types[0] if types else ()
    dims = _Dims()
    plan = _Plan()
    rows = []
    for name, param, grad in _entries(items, as_grads):
        ref = param if param is not None else grad
        if isinstance(ref, DTensor):
            ref_ids = _shard_dims(ref, types, dims, name)
            if ref_ids is None:
                continue  # this rank holds no part of it and takes part in none of its groups
        else:
            ref_ids = ()
        if plan.home is None:
            plan.home = ref.device
        plan.f64 = plan.f64 or ref.dtype == torch.float64
        rows.append((name, param, grad, ref_ids))
    grad_set, sets = _norm_plan([row[3] for row in rows])
    plan.sets = [([dims.by_id[i] for i in ids], [], []) for ids in sets]
    for (name, param, grad, ref_ids), s in zip(rows, grad_set):
        entry = plan.sets[s]
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            target = grad.to_local()
            local = target
            if param is not None:
                grad_ids = _shard_dims(grad, types, dims, name)
                if grad_ids is not None and set(grad_ids) != set(ref_ids):
                    raise _mismatch(name, grad_ids, ref_ids, dims)
            if any(pl.is_partial() for pl in grad.placements):
                Replicate = types[3]
                local = grad.redistribute(grad.device_mesh, [Replicate() if pl.is_partial() else pl
                                                             for pl in grad.placements]).to_local()
        else:
            if ref_ids and param is not None:
                raise _mismatch(name, (), ref_ids, dims)
            target = local = grad
        if _uses_host_kernels(target):
            entry[1].append(local)
            plan.host.append(target)
        elif target.numel():
            entry[2].append(local)
            plan.other.append(target)
    return plan


def _mismatch(name, grad_ids, ref_ids, dims):
    return ValueError(
        f"{name}: the gradient is sharded over the groups {[dims.by_id[i][0] for i in grad_ids]} but its "
        f"parameter over {[dims.by_id[i][0] for i in ref_ids]}; the reduction set comes from the parameter "
        f"(shared by all ranks), so they must agree")


def _reduce_dtype(device_type):
    return torch.float64 if device_type in ("cpu", "cuda") else torch.float32


def _local_value(host, other, p, device, dtype):
    """Σ|x|^p (max |x| for p = inf) over the local tensors, as a 0-dim tensor on `device`: one
    fused host call for the CPU tensors, `_foreach_norm` per (device, dtype) for the others."""
    parts = []
    for ts in _by_device(host):
        parts.append(ops.power_sum(ts, p, True))
    if other:
        groups = {}
        for t in other:
            groups.setdefault((t.device, t.dtype), []).append(t)
        for (_, tdtype), ts in groups.items():
            acc = torch.float64 if tdtype == torch.float64 else torch.float32
            norms = torch.stack(torch._foreach_norm(ts, p, dtype=acc))
            parts.append(norms.max() if p == math.inf else norms.pow(p).sum())
    if not parts:
        return torch.zeros((), dtype=dtype, device=device)
    if len(parts) == 1:
        return parts[0].to(device=device, dtype=dtype)
    stacked = torch.stack([v.to(device=device, dtype=dtype) for v in parts])
    return stacked.max() if p == math.inf else stacked.sum()


def _all_reduce(value, dims, is_max):
    """Reduces `value` over each mesh dim's group in turn (SUM, or MAX carrying NaN)."""
    if not dims:
        return value
    if not is_max:
        for _, group, _ in dims:
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
        return value
    # MAX: gloo's max drops a NaN that is not on the first rank, so send (value with NaN as 0,
    # NaN flag) and restore it. (+inf must stay +inf: no nan_to_num, which clamps it.)
    nan = value.isnan()
    packed = torch.stack([torch.where(nan, torch.zeros_like(value), value), nan.to(value.dtype)])
    for _, group, _ in dims:
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    return torch.where(packed[1] > 0, torch.full_like(packed[0], math.nan), packed[0])


def _total_norm(plan, p):
    """The reduced total norm as a 0-dim tensor on the first parameter's device (f64 on CPU)."""
    home = plan.home
    partials = []
    for dims, host, other in plan.sets:
        device_type = dims[0][2] if dims else home.type
        device = home if device_type == home.type else torch.device(device_type)
        dtype = _reduce_dtype(device_type)
        value = _all_reduce(_local_value(host, other, p, device, dtype), dims, p == math.inf)
        partials.append(value.to(device=home, dtype=torch.float64 if home.type == "cpu" else dtype))
    values = torch.stack(partials) if len(partials) > 1 else partials[0]
    if p == math.inf:
        return values.max() if values.dim() else values
    total = values.sum() if values.dim() else values
    if p == 1.0:
        return total
    if p == 2.0:
        return total.sqrt()
    return total.pow(1.0 / p)


def _nonfinite_error(p, total):
    return RuntimeError(
        f"The total norm of order {p} for gradients from `parameters` is non-finite ({float(total)}), so it "
        "cannot be clipped; the gradients were left unchanged. To get the value back instead of this "
        "error, set `error_if_nonfinite=False`")


def _compute(items, norm_type, error_if_nonfinite, as_grads):
    p = _check_norm_type(norm_type)
    plan = _prepare(items, as_grads)
    if not plan.sets:
        return plan, torch.tensor(0.0)
    total = _total_norm(plan, p)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise _nonfinite_error(p, total)
    return plan, total


def _result(plan, total):
    return total if not plan.sets else total.to(torch.float64 if plan.f64 else torch.float32)


@torch.no_grad()
def get_total_norm(parameters_or_module_or_grads, norm_type=2.0, error_if_nonfinite=False):
    """The placement-aware total p-norm of gradients on any mix of meshes, as a 0-dim tensor.

    Accepts a module (its parameters' gradients), parameters (`nn.Parameter`: their `.grad`;
    None contributes 0) or gradients (any other tensor: the tensor itself, which every rank must
    then pass, as it also defines the collectives). `norm_type`: finite p > 0 or inf (max norm);
    0, negative or NaN raise ValueError. A non-finite total is returned, or with
    `error_if_nonfinite=True` raises RuntimeError. Collective: call on every rank with the same
    list. See the module docstring for the rule, the kernels and the devices.
    """
    plan, total = _compute(parameters_or_module_or_grads, norm_type, error_if_nonfinite, as_grads=True)
    return _result(plan, total)


@torch.no_grad()
def clip_grad_norm_(parameters_or_module, max_norm, norm_type=2.0, error_if_nonfinite=False):
    """Clips the gradients of a module or parameters in place by their placement-aware total
    norm and returns that norm (0-dim tensor), like `torch.nn.utils.clip_grad_norm_` but for
    gradients on any mix of meshes.

    Every local gradient is multiplied by `min(max_norm / (total + 1e-6), 1)` (not touched when
    that is 1); a nan/inf total leaves them untouched and is returned, or raises RuntimeError
    with `error_if_nonfinite=True`. `max_norm` must be >= 0 (inf: only compute the norm).
    Collective: call on every rank with the same parameters (a rank whose `.grad` is None for
    some or all of them takes part all the same). See the module docstring.
    """
    max_norm = float(max_norm)
    if math.isnan(max_norm) or max_norm < 0:
        raise ValueError(f"max_norm must be a number >= 0 (inf disables clipping), got {max_norm!r}")
    plan, total = _compute(parameters_or_module, norm_type, error_if_nonfinite, as_grads=False)
    if plan.host:
        value = float(total)
        if math.isfinite(value):
            coef = min(max_norm / (value + 1e-6), 1.0)
            if coef < 1.0:
                for ts in _by_device(plan.host):
                    ops.foreach_scale_(ts, coef)
    if plan.other:
        # No host synchronisation: a non-finite total gives the coefficient 1 (untouched).
        coef = torch.clamp(max_norm / (total.to(torch.float64) + 1e-6), max=1.0)
        coef = torch.where(torch.isfinite(total), coef, torch.ones_like(coef))
        groups = {}
        for t in plan.other:
            groups.setdefault((t.device, t.dtype), []).append(t)
        for (device, _), ts in groups.items():
            torch._foreach_mul_(ts, coef.to(device=device, dtype=torch.float32))
    return _result(plan, total)


def warmup_grad_norm(model, max_norm=1.0):
    """Runs one placement-aware clip on zero gradients so that every communicator the grad norm
    uses is created now rather than at the first step (as the seed does): each
    `requires_grad` parameter gets `zeros_like(param)` (a DTensor of zeros for DTensors), one
    `clip_grad_norm_(model, max_norm)` runs under no_grad, then every gradient is reset to None
    (also gradients that existed before). Collective: call on every rank."""
    logger.info("Warming up FSDPTurbo mixed-mesh grad norm computation...")
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for p in params:
            p.grad = torch.zeros_like(p)
        try:
            clip_grad_norm_(model, max_norm)
        finally:
            for p in params:
                p.grad = None
    logger.info("FSDPTurbo mixed-mesh grad norm warmup completed.")
