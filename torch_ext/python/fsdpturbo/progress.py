"""Progress bars for work a person waits for (loading, saving, converting): drawn by one
process (rank 0, or the only one) to stderr, only when stderr is a terminal, and only once the
work has taken more than a few seconds; silent everywhere else."""
import sys

import torch.distributed as dist

SHOW_AFTER_S = 3.0


def _draws():
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return False
    return sys.stderr.isatty()


class _Silent:
    def update(self, n=1):
        pass

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def progress(total, desc, unit="B"):
    """A context manager with `update(n)`: a tqdm bar of `total` units (bytes by default, shown
    scaled) where this process draws, else a silent twin."""
    if not _draws():
        return _Silent()
    from tqdm import tqdm

    scaled = unit == "B"
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=scaled, unit_divisor=1024 if scaled else 1000,
                delay=SHOW_AFTER_S, file=sys.stderr, leave=False, dynamic_ncols=True)
