"""Putting a directory in place without destroying what the writer did not write.

A writer stages its output in a directory of its own next to the target (`<path>.partial-<id>`),
syncs it to disk, and renames it into place. The directory it replaces is moved aside to
`<path>.old` first and deleted last, so at every instant one complete copy exists. A target is
replaced only when it is absent, an empty directory, one the caller recognises as its own
output, or when the caller says to overwrite it; a `<path>.old` only when it is the caller's own.
Replaces into one directory hold a lock on it, so that two jobs saving to one path take turns
(the last one's output stands, whole).
"""
import contextlib
import fcntl
import logging
import os
import shutil
import uuid

__all__ = ["check_target", "new_staging", "normalised", "replace", "write_synced"]

logger = logging.getLogger(__name__)


def normalised(path):
    """`path` as one spelling: `ckpt/` and `ckpt` are the same target."""
    return os.path.normpath(os.fspath(path))


def _is_empty_dir(path):
    return os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path)


def check_target(path, *, ours, overwrite, hint):
    """Raises FileExistsError unless `path` may be replaced: absent, an empty directory, a
    directory `ours(path)` recognises, or with `overwrite` any directory. `hint` says what
    `ours` accepts, for the message."""
    if os.path.lexists(path) and not _is_empty_dir(path):
        if os.path.islink(path) or not os.path.isdir(path):
            raise FileExistsError(f"fsdpturbo: {path!r} exists and is not {hint} but a file or a symbolic link; it "
                                  f"is not replaced: give another path")
        if not (overwrite or ours(path)):
            raise FileExistsError(f"fsdpturbo: {path!r} exists and is not {hint}; it is not replaced: give another "
                                  f"path, or overwrite=True to replace it")
    _check_old(path, ours, hint)


def _check_old(path, ours, hint):
    old = path + ".old"
    if os.path.lexists(old) and not (_is_empty_dir(old) or (os.path.isdir(old) and not os.path.islink(old)
                                                            and ours(old))):
        raise FileExistsError(f"fsdpturbo: {old!r} exists and is not {hint}; it is not deleted: move it away so "
                              f"that {path!r} can be replaced")


def new_staging(path):
    """Creates and returns a staging directory of its own next to `path` (and the directories
    above it that do not exist yet: `ckpt/step-500` with no `ckpt`)."""
    staging = f"{path}.partial-{uuid.uuid4().hex[:12]}"
    os.makedirs(os.path.dirname(staging) or ".", exist_ok=True)
    os.mkdir(staging)
    return staging


def _sync(path, flags=os.O_RDONLY):
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(file, data):
    """Writes `data` (bytes) to `file` and syncs it to disk."""
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sync_tree(top):
    """Syncs every file under `top`, then each directory after its contents: what a writer
    (DCP's, a converter's) left unsynced is on disk before the rename makes it visible."""
    for root, _, files in os.walk(top, topdown=False):
        for name in files:
            _sync(os.path.join(root, name))
        _sync(root, os.O_RDONLY | os.O_DIRECTORY)


@contextlib.contextmanager
def _locked(directory):
    """An exclusive lock on `directory` (flock of the directory itself, released when its
    descriptor closes): other processes replacing into it wait."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            logger.warning("fsdpturbo: cannot lock %s (%s): another job replacing a directory there at the same "
                           "time is not kept out", directory, e)
        yield
    finally:
        os.close(fd)


def replace(staging, path, *, ours, overwrite, hint):
    """Moves the complete `staging` directory to `path`: its files and directories are synced,
    then under the parent's lock `path` is checked again as `check_target` checked it before the
    writing (what appeared there meanwhile is kept: FileExistsError), a previous `path` is moved to
    `<path>.old`, `staging` renamed to `path`, the parent synced, and `<path>.old` deleted. A
    `<path>.old` left by an interrupted replace is removed first when `ours` recognises it."""
    _sync_tree(staging)
    parent = os.path.dirname(os.path.abspath(path))
    with _locked(parent):
        check_target(path, ours=ours, overwrite=overwrite, hint=hint)
        old = path + ".old"
        if os.path.lexists(old):
            shutil.rmtree(old)
        if os.path.lexists(path):
            os.rename(path, old)
        os.rename(staging, path)
        _sync(parent, os.O_RDONLY | os.O_DIRECTORY)
        shutil.rmtree(old, ignore_errors=True)
