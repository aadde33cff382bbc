"""Ranks agree before they go on: a rank that fails alone, or was launched with another
configuration, model or checkpoint, would otherwise leave the others waiting in their next
collective until the process-group timeout and then fail with a transport error. Here each
rank-local step is followed by one small all-gather, and every rank raises the same error,
naming the ranks and the cause (`collective_step`) or the first value that differs
(`check_same_on_every_rank`)."""
import functools
import hashlib

import torch.distributed as dist

_SHOWN = 200  # characters of a differing value quoted in an error


def _several_ranks():
    return dist.is_initialized() and dist.get_world_size() > 1


def _gather(value):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


# The classes an `except` written for one process catches, most specific first: a failure on
# every rank is also an instance of the one its causes share.
_KINDS = (FileNotFoundError, FileExistsError, OSError, KeyError, ValueError, TypeError)


def failure_of(exception):
    """What the other ranks learn of an exception: (the name of its kind in _KINDS or None, its
    type and message)."""
    kind = next((k.__name__ for k in _KINDS if isinstance(exception, k)), None)
    return kind, f"{type(exception).__name__}: {exception}"


def every_rank_error(action, failures, error):
    """The exception every rank raises for the failures {rank: failure_of(...)} of `action`: an
    `error` naming each failing rank and its cause (ranks with the same text together), also an
    instance of the kind every cause shares (ValueError, FileNotFoundError, ...) if they do."""
    by_text = {}
    for rank, (_, text) in sorted(failures.items()):
        by_text.setdefault(text, []).append(rank)
    causes = "; ".join(f"rank {ranks[0]}: {text}" if len(ranks) == 1 else f"ranks {ranks}: {text}"
                       for text, ranks in by_text.items())
    kinds = {kind for kind, _ in failures.values()}
    kind = next((k for k in _KINDS if {k.__name__} == kinds), None)
    cls = error if kind is None or issubclass(error, kind) else _combined(error, kind)
    return cls(f"fsdpturbo: {action} failed ({causes})")


@functools.cache
def _combined(error, kind):
    return type(error.__name__, (error, kind), {"__module__": error.__module__, "__str__": BaseException.__str__})


def collective_step(action, step, error=RuntimeError):
    """Runs `step()` on this rank, then one all-gather of (its failure, its result) over the
    default group: when any rank's step raised an Exception, every rank raises
    `every_rank_error` (the failing rank's own exception chained); else returns every rank's
    result (small and picklable), by rank. With one rank or no process group, `step`'s own
    exception propagates unchanged and the result is [step()]."""
    if not _several_ranks():
        return [step()]
    result, failure, cause = None, None, None
    try:
        result = step()
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, then it is raised
        failure, cause = failure_of(e), e
    everyone = _gather((failure, result))
    failures = {rank: failure for rank, (failure, _) in enumerate(everyone) if failure is not None}
    if failures:
        raise every_rank_error(action, failures, error) from cause
    return [value for _, value in everyone]


def model_structure(model):
    """Shape and dtype of each of `model`'s parameters by name (the structure every rank must
    share)."""
    return {name: (tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()}


def _digest(value):
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def _leaves(value, path=""):
    """(key path, repr) of every leaf of nested dicts and lists (a tuple is a leaf), in order."""
    if isinstance(value, dict):
        for key, item in value.items():
            named = isinstance(key, str) and key.isidentifier()
            yield from _leaves(item, (f"{path}.{key}" if path else key) if named else f"{path}[{key!r}]")
    elif isinstance(value, list):
        yield f"{path}(length)", repr(len(value))
        for i, item in enumerate(value):
            yield from _leaves(item, f"{path}[{i}]")
    else:
        yield path or "(the value)", repr(value)


def _shown(text):
    return text if len(text) <= _SHOWN else text[:_SHOWN] + f"… ({len(text)} characters)"


def _first_difference(mine, theirs):
    """(key path, my text, their text) of the first leaf where two values differ."""
    other = dict(_leaves(theirs))
    for path, text in _leaves(mine):
        if other.get(path, "<absent>") != text:
            return path, text, other.get(path, "<absent>")
    ours = dict(_leaves(mine))
    path = next(p for p in other if p not in ours)
    return path, "<absent>", other[path]


def check_same_on_every_rank(fields, where):
    """Raises ValueError on every rank unless every rank passed equal `fields` (an ordered dict
    of name → value with a deterministic repr). One all-gather of digests over the default
    group; when they differ, a second one of the first differing field, so that the error
    names its first differing key path and both values."""
    if not _several_ranks():
        return
    digests = _gather([(name, _digest(value)) for name, value in fields.items()])
    for index, (name, digest) in enumerate(digests[0]):
        differing = [rank for rank, theirs in enumerate(digests) if theirs[index] != (name, digest)]
        if differing:
            values = _gather(fields[name])
            first = differing[0]
            path, ours, theirs = _first_difference(values[0], values[first])
            raise ValueError(f"fsdpturbo: {where}: the ranks disagree on the {name}: rank(s) {differing} differ "
                             f"from rank 0, first at {path}: rank 0 has {_shown(ours)}, rank {first} has "
                             f"{_shown(theirs)}; launch every rank with the same configuration, model and "
                             f"checkpoint")
