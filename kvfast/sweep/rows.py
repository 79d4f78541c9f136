"""One run -> one row: the only place a run's row is made, whatever ends the run.

A row is a dict of the study's result columns plus ``run_id``, ``status``,
``error`` and ``wall_s`` (the config columns are added by the writer). Statuses:

- ``ok``: the run returned a dict with exactly the study's result columns;
- ``error``: the run raised (``SystemExit`` and ``KeyboardInterrupt`` included,
  unless the user's Ctrl-C was seen by the sweep's SIGINT handler: then the
  ``KeyboardInterrupt`` propagates and stops the sweep), or returned the wrong shape;
- ``timeout``: the run passed its time limit (interrupted in place, or its
  worker killed itself and left a marker: see :mod:`kvfast.runtime.worker`);
- ``crashed``: the run killed its worker, and again when re-run alone.

:func:`run_one` never raises for a run's own failure. Rows depend only on the
run's config (``wall_s`` aside).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from kvfast.runtime.worker import INTERRUPTED, RunTimeout, deadline
from kvfast.sweep.grid import GridRun
from kvfast.sweep.procs import RunTree, in_worker, worker_setup

if TYPE_CHECKING:
    from kvfast.sweep.study import Study

CRASH_MESSAGE = "the worker process died during this run, and again when the run was retried alone"


class RunLimits(NamedTuple):
    """How runs are guarded.

    ``seconds``: a run's time limit (``None``: none); ``markers``: the folder where a
    worker that is killed at it leaves a marker; ``reap``: end the processes a run leaves
    behind also outside a pool worker (``--jobs 1``, a warm-up with no pool starting beside
    it; a pool worker always does).
    """

    seconds: float | None
    markers: Path | None
    reap: bool = False


NO_LIMITS = RunLimits(None, None)


def run_one(study: Study, run: GridRun, limits: RunLimits = NO_LIMITS) -> dict:
    """One run as a row of result + bookkeeping columns (never raises for the run's own errors).

    ``SystemExit`` and ``KeyboardInterrupt`` raised by the run's code are ``error``
    rows too (only the user's Ctrl-C, seen by the sweep's SIGINT handler, stops the
    sweep); a run past ``limits``' time limit is a ``timeout`` row.

    A process the run forked (``os.fork()``) never gets back here: when the run
    returns or raises in a process other than the one that called it, that
    process exits at once (``os._exit(0)``), so it cannot run more runs, write
    rows or hold the sweep open.
    """
    clock = time.perf_counter
    t0 = clock()
    seconds, marker_dir, reap = limits
    pid, tree = os.getpid(), RunTree(reap or in_worker())
    try:
        with deadline(seconds, run.run_id, marker_dir):
            try:
                result = study.run(dict(run.config))  # a copy: the run may change it
            finally:
                if os.getpid() != pid:  # a child the run forked returned (or raised) into kvfast's loop
                    os._exit(0)
                tree.end()  # the processes the run left
        if not isinstance(result, dict):
            raise TypeError(f"run returned {type(result).__name__}, not a dict")
        if result.keys() != study.result_fields.keys():
            extra, missing = sorted(result.keys() - study.result_fields), sorted(study.result_fields.keys() - result)
            raise TypeError(f"run returned wrong columns (missing {missing}, unexpected {extra})")
        row = {**result, "run_id": run.run_id, "status": "ok", "error": None}
    except RunTimeout:
        row = _empty_row(study, run, "timeout", _timeout_message(seconds))
    except (Exception, SystemExit, KeyboardInterrupt) as exc:  # noqa: BLE001 - every run's failure becomes a row
        if isinstance(exc, KeyboardInterrupt) and INTERRUPTED.is_set():
            raise
        last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
        where = f" (at {Path(last[0].filename).name}:{last[0].lineno})" if last else ""
        row = _empty_row(study, run, "error", f"{type(exc).__name__}: {exc}{where}")
    row["wall_s"] = clock() - t0
    return row


def run_chunk(study: Study, chunk: tuple[int, list[GridRun]], limits: RunLimits = NO_LIMITS) -> tuple[int, list[dict]]:
    """A task: run every run of one chunk, in order; returns ``(chunk index, rows)``."""
    index, runs = chunk
    return index, [run_one(study, r, limits) for r in runs]


def run_chunk_in_worker(
    study: Study, chunk: tuple[int, list[GridRun]], limits: RunLimits = NO_LIMITS
) -> tuple[int, list[dict]]:
    """:func:`run_chunk` in a pool worker: set the worker up first (see :func:`kvfast.sweep.procs.worker_setup`)."""
    worker_setup()
    return run_chunk(study, chunk, limits)


def lost_worker_row(study: Study, run: GridRun, limits: RunLimits) -> dict:
    """The row of a run whose worker died when it ran alone: ``timeout`` if the worker killed itself at
    the run's time limit (its marker is removed), else ``crashed`` (one line on stderr)."""
    marker = limits.markers / run.run_id if limits.markers else None
    if marker and marker.exists():  # the worker killed itself at the run's time limit
        marker.unlink(missing_ok=True)
        return timeout_row(study, run, limits)
    print(f"kvfast: run {run.run_id} killed its worker, twice; stored as crashed", file=sys.stderr)
    return _empty_row(study, run, "crashed", CRASH_MESSAGE, wall_s=None)


def timeout_row(study: Study, run: GridRun, limits: RunLimits) -> dict:
    """The row of a run whose worker killed itself at the run's time limit."""
    return _empty_row(study, run, "timeout", _timeout_message(limits.seconds), wall_s=None)


def _empty_row(study: Study, run: GridRun, status: str, error: str, **extra) -> dict:
    return {**dict.fromkeys(study.result_fields), "run_id": run.run_id, "status": status, "error": error, **extra}


def _timeout_message(seconds: float | None) -> str:
    return f"RunTimeout: the run took longer than --run-timeout {seconds:g} s"
