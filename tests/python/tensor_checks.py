"""Tensor comparisons and torch's own shard split, shared by the slicing and loading tests."""
import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard


def torch_split_chain(full, mesh_shape, coordinate, placements):
    """torch's own shard splitting (`Placement._split_tensor`, what distribute_tensor runs
    without communication), applied in mesh-dim order."""
    local = full
    for k, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            shards, _ = p._split_tensor(local, mesh_shape[k], with_padding=False)
            local = shards[coordinate[k]]
    return local


_INT_OF = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
           torch.float16: torch.int16}


def bits_equal(a, b):
    """Same shape, dtype and bits (NaN payloads and -0.0 included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = _INT_OF.get(a.dtype)
    return torch.equal(a.view(view), b.view(view)) if view else torch.equal(a, b)
