"""DTensor-exact weight slicing: which part of a full tensor a rank holds, loading a full
checkpoint tensor into a (DTensor) parameter, and assembling the full tensor again.

Slicing is torch DTensor's own (docs/design.md §4.3): torch 2.15's
`_compute_local_shape_and_global_offset`, uneven and empty shards (an empty shard's offset is
the dim's size) and `_StridedShard` included. The rule and the copy plans come from the Rust
core through the `torch.ops.fsdpturbo` ops (`local_shape_and_offset`, `copy_slice_`,
`scatter_slice_`); this module turns torch Placement objects into the ops' integer triples and
does the torch.distributed part.

Placements travel to the ops as one `[kind, dim, split_factor]` triple per mesh dim: kind 0
`Shard(dim)`, 1 `_StridedShard(dim, split_factor)`, 2 `Replicate()`, 3 `Partial()`; fields a
kind does not use are 0.
"""
import itertools
import math

import torch

from ._native import ops

__all__ = ["copy_weights_", "gather_full", "local_shape_and_offset"]

SHARD, STRIDED_SHARD, REPLICATE, PARTIAL = 0, 1, 2, 3
_SHARD_KINDS = (SHARD, STRIDED_SHARD)
_ACCEPTED = "Shard, _StridedShard, Replicate or Partial (torch.distributed.tensor.placement_types)"


def _placement_types():
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # a torch without it
        _StridedShard = None
    return Shard, _StridedShard, Replicate, Partial


def _triples(placements, ndim, where):
    """The ops' flat [kind, dim, split_factor] list of `placements` for a tensor of `ndim` dims
    (negative shard dims normalised, as DTensor does)."""
    Shard, StridedShard, Replicate, Partial = _placement_types()
    out = []
    for k, p in enumerate(placements):
        # _StridedShard first: on some torch versions it is a Shard subclass.
        if StridedShard is not None and isinstance(p, StridedShard):
            kind, dim, split = STRIDED_SHARD, int(p.dim), int(p.split_factor)
        elif isinstance(p, Shard):
            kind, dim, split = SHARD, int(p.dim), 0
        elif isinstance(p, Replicate):
            kind, dim, split = REPLICATE, 0, 0
        elif isinstance(p, Partial):
            kind, dim, split = PARTIAL, 0, 0
        else:
            raise TypeError(f"{where}: placements[{k}] is {p!r} of type {type(p).__qualname__}; "
                            f"accepted: {_ACCEPTED}")
        if kind in _SHARD_KINDS and -ndim <= dim < 0:
            dim += ndim
        out += [kind, dim, split]
    return out


def _kinds(triples):
    return triples[0::3]


def _check_lengths(placements, mesh_shape, coordinate, where):
    if len(placements) != len(mesh_shape):
        raise ValueError(f"{where}: {len(placements)} placements for a mesh of {len(mesh_shape)} dims "
                         f"{tuple(mesh_shape)}; give one placement per mesh dim")
    if coordinate is not None and len(coordinate) != len(mesh_shape):
        raise ValueError(f"{where}: coordinate {tuple(coordinate)} has {len(coordinate)} entries but the "
                         f"mesh {tuple(mesh_shape)} has {len(mesh_shape)} dims")


def _local_shape(global_shape, mesh_shape, coordinate, triples):
    shape, offset = ops.local_shape_and_offset(list(global_shape), list(mesh_shape), list(coordinate), triples)
    return tuple(shape), tuple(offset)


def local_shape_and_offset(global_shape, mesh_shape, coordinate, placements):
    """torch 2.15's `_compute_local_shape_and_global_offset(global_shape, mesh_shape,
    coordinate, placements)`, computed by the Rust core: the shape of the shard at `coordinate`
    of a tensor of `global_shape` placed by `placements` (torch Placement objects, one per mesh
    dim) on a mesh of `mesh_shape`, and the global index of its first element. Returns
    `(local_shape, global_offset)` as tuples of ints."""
    where = "fsdpturbo.local_shape_and_offset"
    global_shape, mesh_shape, coordinate = tuple(global_shape), tuple(mesh_shape), tuple(coordinate)
    _check_lengths(placements, mesh_shape, coordinate, where)
    return _local_shape(global_shape, mesh_shape, coordinate, _triples(placements, len(global_shape), where))


# ----------------------------------------------------------------------------------------------
# Element maps and the two copy paths: the Rust copy plan (CPU) and torch indexing (any device)


def _dim_indices(global_shape, d, mesh_shape, coordinate, triples):
    """The global indices, along tensor dim `d`, of this coordinate's local rows (ascending),
    or None when no placement shards `d`. A tensor dim's map depends only on the placements
    that shard it, so it is the copy plan of the 1-D tensor `arange(global_shape[d])` under
    those placements (every other one replaced by Replicate)."""
    one_d = []
    sharded = False
    for k in range(len(mesh_shape)):
        kind, dim, split = triples[3 * k: 3 * k + 3]
        if kind in _SHARD_KINDS and dim == d:
            one_d += [kind, 0, split]
            sharded = True
        else:
            one_d += [REPLICATE, 0, 0]
    if not sharded:
        return None
    (n,), _ = _local_shape((global_shape[d],), mesh_shape, coordinate, one_d)
    out = torch.empty(n, dtype=torch.int64)
    ops.copy_slice_(out, torch.arange(global_shape[d], dtype=torch.int64), list(mesh_shape), list(coordinate), one_d)
    return out


def _index_plan(global_shape, mesh_shape, coordinate, triples):
    """Per tensor dim: None (whole dim), (start, length) (one block), or an index tensor."""
    plan = []
    for d in range(len(global_shape)):
        idx = _dim_indices(global_shape, d, mesh_shape, coordinate, triples)
        if idx is None:
            plan.append(None)
        elif idx.numel() == 0:
            plan.append((0, 0))
        else:
            start, n = int(idx[0]), idx.numel()
            block = torch.equal(idx, torch.arange(start, start + n, dtype=torch.int64))
            plan.append((start, n) if block else idx)
    return plan


def _narrowed(full, plan):
    """`full` narrowed on its block dims (a view), and the dims that need an index."""
    view, indexed = full, []
    for d, entry in enumerate(plan):
        if isinstance(entry, tuple):
            view = view.narrow(d, entry[0], entry[1])
        elif entry is not None:
            indexed.append(d)
    return view, indexed


def _index_slice(full, mesh_shape, coordinate, triples):
    """This coordinate's slice of `full` by torch indexing on `full`'s device (no host copy of
    the data): a view when every sharded dim is one block, else index_select per strided dim."""
    plan = _index_plan(tuple(full.shape), mesh_shape, coordinate, triples)
    view, indexed = _narrowed(full, plan)
    for d in indexed:
        view = view.index_select(d, plan[d].to(full.device))
    return view


def _index_assign(full, piece, mesh_shape, coordinate, triples):
    """Writes `piece` to its place in `full` by torch indexing on `full`'s device."""
    plan = _index_plan(tuple(full.shape), mesh_shape, coordinate, triples)
    view, indexed = _narrowed(full, plan)
    if not indexed:
        view.copy_(piece)
    elif len(indexed) == 1:
        view.index_copy_(indexed[0], plan[indexed[0]].to(full.device), piece)
    else:  # every dim indexed, broadcast against each other: the index shape is piece's shape
        ndim = view.ndim
        index = []
        for d in range(ndim):
            idx = plan[d] if d in indexed else torch.arange(view.shape[d], dtype=torch.int64)
            index.append(idx.to(full.device).view([-1 if e == d else 1 for e in range(ndim)]))
        view.index_put_(tuple(index), piece)


def _copy_slice(target, full, mesh_shape, coordinate, triples, shape):
    """target <- this coordinate's slice of `full` (cast to target's dtype, moved to its device)."""
    if full.device.type == "cpu":
        if target.device.type == "cpu" and target.dtype == full.dtype:
            ops.copy_slice_(target, full, list(mesh_shape), list(coordinate), triples)
        else:
            buffer = torch.empty(shape, dtype=full.dtype)
            ops.copy_slice_(buffer, full, list(mesh_shape), list(coordinate), triples)
            target.copy_(buffer)
    else:
        target.copy_(_index_slice(full, mesh_shape, coordinate, triples))


def _dtensor_class():
    from torch.distributed.tensor import DTensor

    return DTensor


def _check_shard_order(dtensor, where):
    """Refuses a DTensor whose shards are laid out in a non-default order (torch's `shard_order`
    without _StridedShard), which the placements alone do not describe."""
    spec = getattr(dtensor, "_spec", None)
    if spec is None or getattr(spec, "use_strided_shard_as_shard_order", True):
        return
    order = getattr(spec, "shard_order", None)
    default = getattr(type(spec), "compute_default_shard_order", None)
    if order is not None and default is not None and tuple(order) != tuple(default(spec.placements)):
        raise NotImplementedError(f"{where}: the DTensor has the non-default shard order {order} "
                                  f"(placements {spec.placements}); only the default left-to-right order "
                                  f"and _StridedShard are supported")


def _reject_partial(placements, triples, where, what):
    for k, kind in enumerate(_kinds(triples)):
        if kind == PARTIAL:
            raise ValueError(f"{where}: placements[{k}] is {placements[k]!r}: {what}")


def _load_placement(param, where):
    """(mesh, placements, triples, coordinate) of a DTensor that a full value is loaded into;
    Partial placements and non-default shard orders are refused; the coordinate is None on a
    rank outside the mesh (it holds nothing)."""
    mesh, placements = param.device_mesh, tuple(param.placements)
    triples = _triples(placements, param.ndim, where)
    _reject_partial(placements, triples, where, "loading a full value into a Partial placement would make "
                    "the DTensor's value the sum of the full value over the mesh; load into a "
                    "Shard or Replicate placement and redistribute")
    _check_shard_order(param, where)
    return mesh, placements, triples, mesh.get_coordinate()


def _slice_target(local, shape, where, slice_of):
    """The part of the local tensor `local` that receives this rank's slice of shape `shape`:
    `local` itself, or its leading block when it is padded beyond the slice (the padding is
    zeroed: it must not stay uninitialised). `slice_of` describes the slice in the error."""
    if tuple(local.shape) == tuple(shape):
        return local
    if local.ndim == len(shape) and all(a >= b for a, b in zip(local.shape, shape)):
        local.zero_()
        return local[tuple(slice(0, n) for n in shape)]
    raise ValueError(f"{where}: the local tensor has shape {tuple(local.shape)} but this rank's slice "
                     f"{slice_of} has shape {tuple(shape)}")


def copy_weights_(param, full_tensor):
    """Loads the full (checkpoint) value `full_tensor` into `param`, the seed's `_copy_weights`
    made DTensor-exact. The value is cast to `param`'s dtype. A plain tensor (or nn.Parameter)
    gets the whole value (shapes must match). A DTensor gets exactly the slice torch DTensor
    gives its mesh coordinate: uneven and empty shards and _StridedShard included; on a rank
    outside the DTensor's mesh nothing is done. Partial placements are refused. `full_tensor`
    may live on the CPU (sliced by the Rust copy plan, then copied to the parameter's device)
    or on a device (sliced there by torch indexing). Runs under no_grad; returns `param`."""
    where = "fsdpturbo.copy_weights_"
    DTensor = _dtensor_class()
    if not isinstance(full_tensor, torch.Tensor) or isinstance(full_tensor, DTensor):
        raise TypeError(f"{where}: full_tensor must be a plain torch.Tensor holding the whole value, "
                        f"got {type(full_tensor).__qualname__}")
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"{where}: param must be a tensor, nn.Parameter or DTensor, got {type(param).__qualname__}")
    if tuple(full_tensor.shape) != tuple(param.shape):
        kind = "DTensor of global shape" if isinstance(param, DTensor) else "parameter of shape"
        raise ValueError(f"{where}: the loaded tensor has shape {tuple(full_tensor.shape)} but the {kind} "
                         f"{tuple(param.shape)}")
    with torch.no_grad():
        if not isinstance(param, DTensor):
            param.copy_(full_tensor)
            return param
        mesh, placements, triples, coordinate = _load_placement(param, where)
        if coordinate is None:  # this rank holds nothing of the DTensor (like the seed)
            return param
        mesh_shape = tuple(mesh.shape)
        shape, _ = _local_shape(full_tensor.shape, mesh_shape, coordinate, triples)
        target = _slice_target(param.to_local(), shape, where, f"(mesh {mesh_shape}, coordinate {tuple(coordinate)}, "
                               f"placements {placements}) of {tuple(full_tensor.shape)}")
        _copy_slice(target, full_tensor, mesh_shape, coordinate, triples, shape)
    return param


# ----------------------------------------------------------------------------------------------
# gather_full

_HEADER_ALIGN = 16


def _round_up(n, m):
    return (n + m - 1) // m * m


def _all_gather_rows(send, mesh, shard_mesh_dims):
    """All-gathers the byte rows `send` over this rank's group of the shard mesh dims: one
    all-gather on the mesh dim's group when one dim shards, one on the default group when the
    shard dims span every rank, else one per shard dim (innermost first). Returns [rows, bytes];
    rows carry their sender's coordinate, so their order does not matter."""
    import torch.distributed as dist

    row = send.numel()
    sizes = [mesh.size(k) for k in shard_mesh_dims]
    ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
    if len(shard_mesh_dims) == 1:
        steps = [(mesh.get_group(shard_mesh_dims[0]), sizes[0])]
    elif math.prod(sizes) == dist.get_world_size() and ranks == list(range(dist.get_world_size())):
        steps = [(None, dist.get_world_size())]
    else:
        steps = [(mesh.get_group(k), mesh.size(k)) for k in reversed(shard_mesh_dims)]
    buf = send
    for group, n in steps:
        out = torch.empty(n * buf.numel(), dtype=torch.uint8, device=send.device)
        dist.all_gather_into_tensor(out, buf, group=group)
        buf = out
    return buf.view(-1, row)


def gather_full(tensor, mesh=None, placements=None, global_shape=None):
    """The full tensor of a sharded tensor, on every rank of its mesh, bitwise equal to torch's
    `DTensor.full_tensor()`. `tensor` is a DTensor, or this rank's local tensor together with
    `mesh` (a DeviceMesh), `placements` and `global_shape`. Every rank's local is all-gathered
    as bytes (padded to the largest local) over the mesh dims that shard it; each piece goes
    to its place by the Rust copy plan (CPU) or by torch indexing (other devices). Replicate
    dims take no communication: as in torch, a rank assembles the shards of its own replica.
    Partial placements are refused (reduce them first)."""
    where = "fsdpturbo.gather_full"
    DTensor = _dtensor_class()
    if isinstance(tensor, DTensor):
        if mesh is not None or placements is not None or global_shape is not None:
            raise ValueError(f"{where}: a DTensor carries its mesh, placements and shape; pass none of them")
        _check_shard_order(tensor, where)
        mesh, placements, global_shape = tensor.device_mesh, tuple(tensor.placements), tuple(tensor.shape)
        local = tensor.to_local()
    elif isinstance(tensor, torch.Tensor):
        if mesh is None or placements is None or global_shape is None:
            raise ValueError(f"{where}: for a local tensor pass mesh, placements and global_shape")
        local, placements, global_shape = tensor, tuple(placements), tuple(global_shape)
    else:
        raise TypeError(f"{where}: expected a DTensor or a local tensor, got {type(tensor).__qualname__}")
    mesh_shape = tuple(mesh.shape)
    _check_lengths(placements, mesh_shape, None, where)
    triples = _triples(placements, len(global_shape), where)
    _reject_partial(placements, triples, where, "a Partial value is not a slice of the full tensor; reduce it first "
                    "(redistribute to Replicate)")
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"{where}: this rank is not in the mesh {mesh}; only its ranks hold the tensor")
    coordinate = tuple(coordinate)
    shape, _ = _local_shape(global_shape, mesh_shape, coordinate, triples)
    local = local.detach()
    if tuple(local.shape) != shape:
        if local.ndim == len(shape) and all(a >= b for a, b in zip(local.shape, shape)):
            local = local[tuple(slice(0, n) for n in shape)]  # padded: the slice is its leading block
        else:
            raise ValueError(f"{where}: the local tensor has shape {tuple(local.shape)} but this rank's slice "
                             f"(mesh {mesh_shape}, coordinate {coordinate}, placements {placements}) of "
                             f"{global_shape} has shape {shape}")

    shard_mesh_dims = [k for k in range(len(mesh_shape))
                       if triples[3 * k] in _SHARD_KINDS and mesh_shape[k] > 1]
    if not shard_mesh_dims:
        return local.clone(memory_format=torch.contiguous_format)

    # Every coordinate that differs from ours only on the shard dims, with its local shape.
    pieces = {}
    for values in itertools.product(*(range(mesh_shape[k]) for k in shard_mesh_dims)):
        c = list(coordinate)
        for k, v in zip(shard_mesh_dims, values):
            c[k] = v
        pieces[tuple(c)] = _local_shape(global_shape, mesh_shape, c, triples)[0]
    elem = local.element_size()
    header = _round_up(8 * len(mesh_shape), _HEADER_ALIGN)
    max_bytes = max(math.prod(s) for s in pieces.values()) * elem
    send = torch.zeros(header + _round_up(max_bytes, _HEADER_ALIGN), dtype=torch.uint8, device=local.device)
    send[:header].view(torch.int64)[: len(mesh_shape)] = torch.tensor(coordinate, dtype=torch.int64)
    nbytes = local.numel() * elem
    if nbytes:
        send[header: header + nbytes] = local.contiguous().reshape(-1).view(torch.uint8)

    rows = _all_gather_rows(send, mesh, shard_mesh_dims)
    senders = rows[:, :header].contiguous().view(torch.int64)[:, : len(mesh_shape)].cpu().tolist()
    full = torch.empty(global_shape, dtype=local.dtype, device=local.device)
    seen, total = set(), 0
    for r, sender in enumerate(senders):
        sender = tuple(sender)
        if sender not in pieces:  # another replica (only with the default group): not ours
            continue
        if sender in seen:
            raise RuntimeError(f"{where}: internal error: two pieces from coordinate {sender}")
        seen.add(sender)
        piece_shape = pieces[sender]
        n = math.prod(piece_shape)
        piece = rows[r, header: header + n * elem].view(local.dtype).view(piece_shape)
        if full.device.type == "cpu":
            ops.scatter_slice_(full, piece, list(mesh_shape), list(sender), triples)
        else:
            _index_assign(full, piece, mesh_shape, sender, triples)
        total += n
    if len(seen) != len(pieces) or total != full.numel():
        raise RuntimeError(f"{where}: internal error: {len(seen)} of {len(pieces)} pieces holding {total} "
                           f"of {full.numel()} elements")
    return full
