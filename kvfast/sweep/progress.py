"""A sweep's progress on stderr, counted over the whole grid: runs stored before the sweep started count as done.

- stderr a terminal with columns: a tqdm bar (runs of the grid done, runs/s, errors, time left);
- anywhere else (a pipe, a file, a terminal of zero width as ``script`` without a terminal size gives): a line
  every :data:`EVERY` seconds, ``kvfast: 1,234 of 10,800 runs (661 stored before), 350 runs/s, about 27 s left``;
- ``quiet``: nothing.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

import numpy as np

EVERY = 5.0  # seconds between two plain-text progress lines


def runs_per_second(runs: int, seconds: float) -> str:
    """``runs / seconds`` as printed: whole numbers from 100 up (``1,234``), else two significant digits (``0.49``,
    ``3.5``, ``12``), never rounded to ``0``; ``0`` when nothing ran, ``-`` with no time measured."""
    if seconds <= 0:
        return "0" if runs == 0 else "-"
    rate = runs / seconds
    if rate >= 100 or rate == 0:
        return f"{rate:,.0f}"
    return np.format_float_positional(rate, precision=2, unique=False, fractional=False, trim="-")


def meter(total: int, done: int, desc: str, quiet: bool):
    """The progress display of a sweep of ``total`` runs, ``done`` of them stored before it started: an object
    with tqdm's ``update(n)``, ``set_postfix(errors=N)`` and ``close()``."""
    if not quiet and _columns(sys.stderr) > 0:
        from tqdm import tqdm

        return tqdm(total=total, initial=done, desc=desc, unit="run", dynamic_ncols=True, smoothing=0.1)
    return Lines(total, done, None if quiet else sys.stderr)


def _columns(stream: TextIO) -> int:
    """The width of the terminal ``stream`` writes to; 0 when it is not a terminal."""
    try:
        return os.get_terminal_size(stream.fileno()).columns if stream.isatty() else 0
    except (AttributeError, OSError, ValueError):  # no file descriptor (replaced, closed)
        return 0


class Lines:
    """Progress as a line of text on ``stream`` at most every :data:`EVERY` seconds, as runs finish (``None``: none).

    The rate is that since the previous line (since the start for the first), the time left the runs not yet
    stored at that rate."""

    def __init__(self, total: int, done: int, stream: TextIO | None) -> None:
        self.total, self.before, self.n, self.errors, self.stream = total, done, done, 0, stream
        self.mark = (time.monotonic(), done)

    def set_postfix(self, errors: int = 0, refresh: bool = False) -> None:
        self.errors = errors

    def update(self, n: int) -> None:
        self.n += n
        now = time.monotonic()
        then, n_then = self.mark
        if self.stream is None or now - then < EVERY or self.n >= self.total:  # the end: the closing line
            return
        self.mark = (now, self.n)
        rate = (self.n - n_then) / (now - then)
        errors = f", {self.errors:,} errors" if self.errors else ""
        left = (self.total - self.n) / rate  # rate > 0: runs finished since the mark
        left = f"{left:.0f} s" if left < 120 else f"{left / 60:.0f} min" if left < 7200 else f"{left / 3600:.1f} h"
        print(
            f"kvfast: {self.n:,} of {self.total:,} runs ({self.before:,} stored before){errors}, "
            f"{runs_per_second(self.n - n_then, now - then)} runs/s, about {left} left",
            file=self.stream,
            flush=True,
        )

    def close(self) -> None:
        pass
