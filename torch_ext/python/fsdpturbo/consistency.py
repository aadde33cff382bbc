"""Launch consistency: before a rank builds meshes or issues collectives that depend on its
configuration, every rank checks with one small all-gather that all ranks agree on it. A rank
launched with another config would otherwise leave the others waiting in a collective until
the process-group timeout; here every rank raises the same error, naming the first differing
field and the ranks that differ."""
import hashlib

import torch.distributed as dist

_SHOWN = 160  # characters of a differing value quoted in the error


def _digest(value):
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def model_structure(model):
    """Names, shapes and dtypes of `model`'s parameters (the structure every rank must share)."""
    return [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()]


def check_same_on_every_rank(fields, where):
    """Raises ValueError on every rank unless every rank passed equal `fields` (an ordered dict
    of name → value with a deterministic repr). One all-gather over the default group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = [(name, _digest(value), repr(value)[:_SHOWN]) for name, value in fields.items()]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    digests = [{name: digest for name, digest, _ in theirs} for theirs in everyone]
    shown = [{name: text for name, _, text in theirs} for theirs in everyone]
    for name in digests[0]:
        differing = [rank for rank, theirs in enumerate(digests) if theirs.get(name) != digests[0][name]]
        if differing:
            first = differing[0]
            raise ValueError(f"fsdpturbo: {where}: the ranks disagree on the {name}: rank 0 has {shown[0][name]}, "
                             f"rank(s) {differing} differ (rank {first}: {shown[first].get(name, '<missing>')}); "
                             f"launch every rank with the same configuration and model")
