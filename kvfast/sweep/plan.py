"""Planning a sweep: which runs are pending, which one warms up, and how the rest are cut into chunks.

- :func:`find_pending`: one pass over the grid's ids (no configs built) looked up
  in the stored ids: a flag per run, and the stored statuses of the others.
- :func:`pending_runs`: the pending runs, generated lazily in expansion order.
- :func:`split_warmup`: the run that executes in the sweep's own process first
  (never one that has killed a process), and the runs left.
- :class:`Planner`: cuts runs into chunks lazily, as workers ask for work.

Nothing here runs a run or touches the store; the grid is never materialised.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from kvfast.sweep.grid import Grid, GridRun
from kvfast.sweep.store import STATUSES, StoredIndex


class Pending(NamedTuple):
    """What a sweep must run: ``total`` runs, found by looking the grid's ids up in the stored ones."""

    total: int
    mask: np.ndarray | None  # one flag per grid run, in expansion order: pending; None: every run
    skipped_counts: dict[str, int]  # status -> grid runs not re-run, by their stored status
    retried: set[str]  # ids of pending runs that have a stored row (error/crashed with retry_errors)
    retried_counts: dict[str, int]


_BATCH = 1 << 14


def find_pending(grid: Grid, stored: StoredIndex, redo: tuple[str, ...]) -> Pending:
    """One pass over the grid's ids (no configs built): which runs are pending, and the stored statuses."""
    if not len(stored):
        return Pending(len(grid), None, {}, set(), {})
    redo_codes = np.array([STATUSES.index(s) for s in redo], np.int8)
    skipped = np.zeros(len(STATUSES), np.int64)
    retried: set[str] = set()
    retried_counts = np.zeros(len(STATUSES), np.int64)
    masks = []
    ids = grid.iter_ids()
    while batch := list(itertools.islice(ids, _BATCH)):
        codes = stored.lookup(batch)
        redo_mask = np.isin(codes, redo_codes)
        pending = (codes < 0) | redo_mask
        masks.append(pending)
        skipped += np.bincount(codes[~pending], minlength=len(STATUSES))[: len(STATUSES)]
        if redo_mask.any():
            retried.update(b for b, m in zip(batch, redo_mask, strict=True) if m)
            retried_counts += np.bincount(codes[redo_mask], minlength=len(STATUSES))[: len(STATUSES)]
    mask = np.concatenate(masks) if masks else np.zeros(0, bool)

    def by_status(counts: np.ndarray) -> dict[str, int]:
        return {STATUSES[i]: int(n) for i, n in enumerate(counts) if n}

    return Pending(int(mask.sum()), mask, by_status(skipped), retried, by_status(retried_counts))


def _flags(mask: np.ndarray) -> Iterator[bool]:
    for start in range(0, len(mask), _BATCH):
        yield from mask[start : start + _BATCH].tolist()


def pending_runs(grid: Grid, plan: Pending) -> Iterator[GridRun]:
    """The grid's pending runs, in expansion order, generated lazily (no id computed for the others)."""
    return grid.iter_runs(None if plan.mask is None else _flags(plan.mask))


class Planner:
    """Cuts runs into chunks lazily, as workers ask for work (the runs come from an iterator).

    A chunk holds about ``chunk_s`` seconds of work, from the median wall time of
    the last runs finished (one run per chunk until a time is known), and no more
    than ``total / (4 * workers)`` runs, so each worker gets at least four
    chunks and the tail stays balanced. ``fixed`` overrides the size. Chunks
    handed out and not yet returned are kept in ``handed``.
    """

    def __init__(
        self, runs: Iterator[GridRun], total: int, workers: int, chunk_s: float, fixed: int | None, recent: deque
    ) -> None:
        self.runs = iter(runs)
        self.total = total
        self.taken = 0
        self.chunk_s = chunk_s
        self.fixed = fixed
        self.recent = recent
        self.cap = max(1, math.ceil(total / (4 * workers)))
        self.handed: dict[int, list[GridRun]] = {}
        self.count = 0
        self.largest = 0

    def size(self) -> int:
        if self.fixed:
            return self.fixed
        times = list(self.recent)
        if not times:
            return 1
        return max(1, min(self.cap, round(self.chunk_s / max(statistics.median(times), 1e-6))))

    def take(self) -> tuple[int, list[GridRun]] | None:
        """The next chunk ``(index, runs)``, or ``None`` when every run has been handed out."""
        chunk = list(itertools.islice(self.runs, self.size()))
        if not chunk:
            return None
        self.taken += len(chunk)
        index = self.count
        self.count += 1
        self.handed[index] = chunk
        self.largest = max(self.largest, len(chunk))
        return index, chunk

    def returned(self, index: int) -> list[GridRun]:
        """The runs of chunk ``index``, which came back."""
        return self.handed.pop(index)

    def rest(self) -> tuple[Iterator[GridRun], int]:
        """Runs not handed out yet, and how many."""
        return self.runs, self.total - self.taken


LOOK = 256
"""How many pending runs, from the first, :func:`split_warmup` looks at for warm-up runs."""


def split_warmup(
    pending: Iterator[GridRun], avoid: set[str], look: int = LOOK
) -> tuple[list[GridRun], Iterator[GridRun]]:
    """The warm-up run and every other pending run, in order: ``(first, rest)``.

    ``first`` (a list of at most one) is the first pending run whose id is not in ``avoid`` (runs
    that killed a process), among the first ``look`` runs; none if all of those are avoided.
    ``rest``: every pending run not in ``first``, in order.
    """
    skipped: list[GridRun] = []
    for run in itertools.islice(pending, look):
        if run.run_id not in avoid:
            return [run], itertools.chain(skipped, pending)
        skipped.append(run)
    return [], itertools.chain(skipped, pending)
