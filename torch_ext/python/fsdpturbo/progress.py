"""A byte progress bar for long loads and saves: drawn on rank 0 only, to stderr only when it is
a terminal, and only once the work has run for `delay` seconds (quick loads print nothing).
Self-contained (no tqdm): `with Progress(total_bytes, "loading") as bar: bar.update(n)`."""
import os
import sys
import time

__all__ = ["Progress"]

_WIDTH = 24


def _is_rank0():
    """Rank 0 of the process group, or, before there is one, of the launcher (RANK)."""
    import torch.distributed as dist

    from ._dist import rank

    return rank() == 0 if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0")) == 0


def _gb(n):
    return f"{n / 1e9:.2f}"


class Progress:
    """`total` units (bytes) of work described by `desc`. `stream` (default sys.stderr) is drawn
    on when `enabled` (default: rank 0 and the stream is a terminal), first after `delay`
    seconds, then at most every `interval` seconds; `close()` ends the line if anything was drawn."""

    def __init__(self, total, desc, *, delay=3.0, interval=0.25, stream=None, enabled=None):
        self.total, self.desc, self.delay, self.interval = max(int(total), 0), desc, delay, interval
        self.stream = sys.stderr if stream is None else stream
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = _is_rank0() and bool(isatty and isatty())
        self.enabled = enabled
        self.done = 0
        self.start = time.monotonic()
        self._last = None  # when the bar was last drawn (None: never)

    def update(self, n):
        self.done += int(n)
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.start < self.delay or (self._last is not None and now - self._last < self.interval):
            return
        self._draw(now)

    def _draw(self, now):
        elapsed = max(now - self.start, 1e-9)
        frac = self.done / self.total if self.total else 1.0
        filled = int(_WIDTH * min(frac, 1.0))
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 and self.total > self.done else 0.0
        self.stream.write(f"\r{self.desc}: {100 * frac:3.0f}% |{'#' * filled}{' ' * (_WIDTH - filled)}| "
                          f"{_gb(self.done)}/{_gb(self.total)} GB, {rate / 1e6:.0f} MB/s, eta {eta:.0f} s ")
        self.stream.flush()
        self._last = now

    def close(self):
        if self.enabled and self._last is not None:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
