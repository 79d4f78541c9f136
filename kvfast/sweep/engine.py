"""Running a grid: chunks fanned out by joblib (loky, threading) or Dask, rows into Parquet parts.

Contract of :func:`run_sweep`:

- Everything is validated (backend, jobs, output directory, Dask scheduler)
  before the first run; a problem is a ``ValueError`` and nothing stored is touched.
- Only runs not stored with ``status="ok"`` run (``retry_errors``: also those
  stored as ``error``/``crashed``; ``fresh``: stored results are deleted first).
- One pending run executes in this process first (Numba compiles, or loads
  its cache, once, here, before workers start). The rest are cut into chunks
  lazily, as workers ask for work: about ``chunk_s`` of work per chunk (from
  the times of runs finished so far), at least four chunks per worker.
- A run that raises is an ``error`` row (its message in ``error``), ``SystemExit``
  and ``KeyboardInterrupt`` included; the sweep goes on. A chunk whose worker
  dies is re-run one run at a time, each alone in a worker; a run that kills
  its worker again is a ``crashed`` row. With ``run_timeout`` a run past its
  limit is a ``timeout`` row (see :mod:`kvfast.sweep.guard`).
- Workers die with the sweep process and ignore SIGINT; Ctrl-C kills them.
- A failed write (disk full) is a :class:`~kvfast.sweep.store.StorageError`
  saying how many runs are stored.
- Finished chunks are written as a part within about a second (or
  every :data:`~kvfast.sweep.store.PART_ROWS` rows), so an interrupted sweep loses
  only chunks in flight; at the end the parts are compacted.
- The grid is never materialised: pending runs are generated from it as chunks
  are handed out, and what is stored is looked up in sorted arrays of ids, so
  memory is bounded by the chunks in flight, not by the grid.
- Dask futures are driven directly (no joblib Dask backend), with a stall
  timeout: if nothing finishes for ``stall_s`` seconds, or the scheduler is
  lost, the sweep stops and the report lists the lost runs and why (not
  stored; the next sweep runs them). ``KilledWorker`` is a dead worker.
- A run's numbers depend only on its config, never on backend, worker count,
  chunking or completion order.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import math
import os
import pickle
import signal
import statistics
import sys
import threading
import time
import traceback
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import pyarrow as pa

from kvfast.sweep.grid import Grid, Run
from kvfast.sweep.guard import INTERRUPTED, RunTimeout, deadline, on_sigint, worker_start
from kvfast.sweep.limits import check_disk, check_memory
from kvfast.sweep.store import (
    FORMAT,
    PART_ROWS,
    STATUSES,
    TIMEOUTS,
    WARMUP,
    ResultsDir,
    StorageError,
    StoredIndex,
    new_manifest,
    schema_for,
    versions,
)

if TYPE_CHECKING:
    from kvfast.studies.base import Study

BACKENDS = ("fork", "loky", "threading", "dask")
CRASH_MESSAGE = "the worker process died during this run, and again when the run was retried alone"


@dataclass
class SweepReport:
    """What a sweep did. ``counts``: status -> runs of this grid now stored (after the sweep)."""

    study: str
    out: Path
    total: int
    skipped: int
    ran: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    lost_reason: str = ""
    wall_s: float = 0.0
    compute_s: float = 0.0
    workers: int = 1
    chunk_size: int = 0
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        """True when every run of the grid is stored with status ``ok``."""
        return not self.lost and not self.interrupted and self.counts.get("ok", 0) == self.total

    def line(self) -> str:
        """A one-line summary."""
        rate = self.ran / self.wall_s if self.wall_s > 0 else 0.0
        counts = ", ".join(f"{s} {self.counts.get(s, 0):,}" for s in STATUSES)
        text = (
            f"{self.study}: {self.total:,} runs in the grid, {self.skipped:,} already stored, "
            f"{self.ran:,} run now in {self.wall_s:.1f} s ({rate:,.0f} runs/s, {self.workers} workers); "
            f"{counts}; results in {self.out}"
        )
        if self.lost:
            why = f" ({self.lost_reason})" if self.lost_reason else ""
            text += (
                f"; LOST {len(self.lost):,} runs{why}, not stored, a plain rerun runs them: {', '.join(self.lost[:5])}"
            )
            text += " ..." if len(self.lost) > 5 else ""
        if self.interrupted:
            text += "; INTERRUPTED (run again to resume)"
        return text


def _run_one(study: Study, run: Run, limits: Limits = None) -> dict:
    """One run as a row of result + bookkeeping columns (never raises for the run's own errors).

    ``SystemExit`` and ``KeyboardInterrupt`` raised by the run's code are ``error``
    rows too (only the user's Ctrl-C, seen by the sweep's SIGINT handler, stops the
    sweep); a run past ``limits``' time limit is a ``timeout`` row.
    """
    clock = time.perf_counter
    t0 = clock()
    seconds, marker_dir = limits or (None, None)
    try:
        with deadline(seconds, run.run_id, marker_dir):
            result = study.run(dict(run.config))
        if type(result) is not dict or result.keys() != study.result_fields.keys():
            _wrong_result(study, result)
        row = dict(result)
        row["run_id"] = run.run_id
        row["status"] = "ok"
        row["error"] = None
    except RunTimeout:
        row = {f: None for f in study.result_fields}
        row.update(run_id=run.run_id, status="timeout", error=_timeout_message(seconds))
    except (Exception, SystemExit, KeyboardInterrupt) as exc:  # noqa: BLE001 - every run's failure becomes a row
        if isinstance(exc, KeyboardInterrupt) and INTERRUPTED.is_set():
            raise
        row = {f: None for f in study.result_fields}
        last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
        where = f" (at {Path(last[0].filename).name}:{last[0].lineno})" if last else ""
        row.update(run_id=run.run_id, status="error", error=f"{type(exc).__name__}: {exc}{where}")
    row["wall_s"] = clock() - t0
    return row


def _timeout_message(seconds: float | None) -> str:
    return f"RunTimeout: the run took longer than --run-timeout {seconds:g} s"


def _wrong_result(study: Study, result) -> None:
    if not isinstance(result, dict):
        raise TypeError(f"run returned {type(result).__name__}, not a dict")
    if set(result) != set(study.result_fields):
        extra = sorted(set(result) - set(study.result_fields))
        missing = sorted(set(study.result_fields) - set(result))
        raise TypeError(f"run returned wrong columns (missing {missing}, unexpected {extra})")


Limits = tuple | None  # (run time limit in seconds or None, folder for timeout markers or None)


def run_chunk(study: Study, chunk: tuple[int, list[Run]], limits: Limits = None) -> tuple[int, list[dict]]:
    """A task: run every run of one chunk, in order; returns ``(chunk index, rows)``."""
    index, runs = chunk
    return index, [_run_one(study, r, limits) for r in runs]


def _run_chunk_in_worker(study: Study, chunk: tuple[int, list[Run]], limits: Limits = None):
    worker_start()
    return run_chunk(study, chunk, limits)


class _Writer:
    """Turns result rows into Arrow tables of the study's schema and writes parts.

    Tables are buffered and written as one part when ``flush_s`` seconds have
    passed since the last write or :data:`PART_ROWS` rows are buffered (and by
    :meth:`flush`). ``counts``: status -> runs written by this sweep.
    """

    def __init__(self, store: ResultsDir, study: Study, progress, flush_s: float = 1.0) -> None:
        self.store = store
        self.study = study
        self.schema = schema_for(study)
        self.config_names = list(study.config_fields)
        self.progress = progress
        self.flush_s = flush_s
        self.buffer: list[pa.Table] = []
        self.buffered = 0
        self.last_flush = time.monotonic()
        self.ran = 0
        self.errors = 0
        self.counts: dict[str, int] = {}
        self.written: set[str] = set()  # ids of runs written that had a stored row before (see ``watch``)
        self.watch: set[str] = set()
        self.compute_s = 0.0
        self.recent: deque = deque(maxlen=64)

    def __call__(self, runs: Sequence[Run], rows: list[dict]) -> None:
        if not rows:
            return
        configs = {r.run_id: r.config for r in runs} if len(runs) != len(rows) else None
        if configs is None and any(r.run_id != row["run_id"] for r, row in zip(runs, rows, strict=True)):
            configs = {r.run_id: r.config for r in runs}
        ordered = [configs[row["run_id"]] for row in rows] if configs is not None else [r.config for r in runs]
        columns = {"run_id": [row["run_id"] for row in rows]}
        for name in self.config_names:
            columns[name] = [c[name] for c in ordered]
        for name in self.schema.names[1 + len(self.config_names) :]:
            columns[name] = [row[name] for row in rows]
        statuses = columns["status"]
        try:
            table = pa.Table.from_pydict(columns, schema=self.schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError, ValueError):
            full = [{**c, **row} for c, row in zip(ordered, rows, strict=True)]
            table = pa.concat_tables([self._one_row(r) for r in full])
            statuses = table.column("status").to_pylist()
        self.buffer.append(table)
        self.buffered += len(rows)
        for r, status in zip(rows, statuses, strict=True):
            self.counts[status] = self.counts.get(status, 0) + 1
            self.compute_s += r["wall_s"] or 0.0
            if status == "ok":
                self.recent.append(r["wall_s"])
            else:
                self.errors += 1
            if self.watch and r["run_id"] in self.watch:
                self.written.add(r["run_id"])
        self.ran += len(rows)
        if self.buffered >= PART_ROWS or time.monotonic() - self.last_flush >= self.flush_s:
            self.flush()
        if self.progress is not None:
            self.progress.update(len(rows))
            self.progress.set_postfix(errors=self.errors, refresh=False)

    def flush(self) -> None:
        """Write the buffered rows as one part."""
        if self.buffer:
            self.store.write_part(self.buffer)
        self.buffer, self.buffered = [], 0
        self.last_flush = time.monotonic()

    def _one_row(self, row: dict) -> pa.Table:
        try:
            return pa.Table.from_pylist([row], schema=self.schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError, ValueError):
            pass
        bad = "?"
        for name, typ in self.study.result_fields.items():
            try:
                pa.array([row[name]], type=typ)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError, ValueError):
                bad = f"{name}: {row[name]!r} does not fit type {typ}"
                break
        fixed = dict(row, status="error", error=f"ResultTypeError: {bad}")
        fixed.update({f: None for f in self.study.result_fields})
        return pa.Table.from_pylist([fixed], schema=self.schema)


class _Planner:
    """Cuts runs into chunks lazily, as workers ask for work (the runs come from an iterator).

    A chunk holds about ``chunk_s`` seconds of work, from the median wall time of
    the last runs finished (one run per chunk until a time is known), and no more
    than ``total / (4 * workers)`` runs, so each worker gets at least four
    chunks and the tail stays balanced. ``fixed`` overrides the size. Chunks
    handed out and not yet returned are kept in ``handed``.
    """

    def __init__(
        self, runs: Iterator[Run], total: int, workers: int, chunk_s: float, fixed: int | None, recent: deque
    ) -> None:
        self.runs = iter(runs)
        self.total = total
        self.taken = 0
        self.chunk_s = chunk_s
        self.fixed = fixed
        self.recent = recent
        self.cap = max(1, math.ceil(total / (4 * workers)))
        self.handed: dict[int, list[Run]] = {}
        self.count = 0
        self.largest = 0

    def size(self) -> int:
        if self.fixed:
            return self.fixed
        times = list(self.recent)
        if not times:
            return 1
        return max(1, min(self.cap, round(self.chunk_s / max(statistics.median(times), 1e-6))))

    def take(self) -> tuple[int, list[Run]] | None:
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

    def returned(self, index: int) -> list[Run]:
        """The runs of chunk ``index``, which came back."""
        return self.handed.pop(index)

    def rest(self) -> tuple[Iterator[Run], int]:
        """Runs not handed out yet, and how many."""
        return self.runs, self.total - self.taken


def _loaded(study: Study) -> int:
    """A worker's no-op task: unpickling ``study`` imported its module."""
    worker_start()
    return os.getpid()


def _loky_pool(n_jobs: int):
    """loky's reusable pool of ``n_jobs`` workers (started by this process; each dies with it)."""
    from joblib.externals.loky import get_reusable_executor

    return get_reusable_executor(max_workers=n_jobs, initializer=worker_start, initargs=(os.getpid(),))


def _preheat(study: Study, jobs: int) -> None:
    """Start the loky pool (the one the sweep then reuses) and import the study in every worker."""
    try:
        pool = _loky_pool(jobs)
        for fut in [pool.submit(_loaded, study) for _ in range(jobs)]:
            fut.result()
    except Exception:  # noqa: BLE001 - only a head start; the sweep itself reports any failure
        pass


def _preheat_dask(client, study: Study) -> None:
    try:
        client.run(_loaded, study)
    except Exception:  # noqa: BLE001 - only a head start
        pass


def _execute_threads(study: Study, runs: Iterator[Run], total: int, n_jobs: int, plan, write, limits: Limits) -> None:
    """Fan chunks out to threads of this process (joblib's threading backend).

    A time limit interrupts a run's Python code only: a thread cannot be killed, so
    a run blocked in C code (a sleep, a Numba kernel) runs until it returns.
    """
    from joblib import Parallel, delayed

    planner = plan(runs, total)

    def tasks() -> Iterator:
        while (chunk := planner.take()) is not None:
            yield delayed(run_chunk)(study, chunk, limits)

    parallel = Parallel(n_jobs=n_jobs, backend="threading", batch_size=1, return_as="generator_unordered")
    with warnings.catch_warnings():  # joblib's note about tasks cancelled by an interrupt
        warnings.filterwarnings("ignore", message=".*tasks have been successfully executed")
        for index, rows in parallel(tasks()):
            write(planner.returned(index), rows)


_FORKED: list = []  # (study, limits), as forked workers inherit them (nothing to pickle but the chunks)


def _run_chunk_forked(chunk: tuple[int, list[Run]]) -> tuple[int, list[dict]]:
    study, limits = _FORKED[-1]
    return run_chunk(study, chunk, limits)


# Libraries whose native thread pools do not survive a fork: once the warm-up run has imported one
# (a study that builds torch models), a forked worker blocks forever on a lock held by a thread that
# was not copied. Such sweeps use loky (fresh interpreters) instead.
FORK_UNSAFE = ("torch", "tensorflow", "jax")


def fork_unsafe_modules() -> list[str]:
    """The :data:`FORK_UNSAFE` libraries this process has imported."""
    return [name for name in FORK_UNSAFE if name in sys.modules]


def _execute_pool(
    study: Study, runs: Iterator[Run], total: int, backend: str, n_jobs: int, plan, write, limits: Limits
) -> None:
    """Fan chunks out to a process pool: ``fork`` (forked from this process after its warm-up: workers
    start in milliseconds and inherit the compiled kernels) or ``loky`` (fresh interpreters).

    About two chunks per worker are in flight. A dead worker breaks the pool: the
    chunks in flight are re-run one run at a time, each alone in a new one-worker
    pool; a run that kills that worker too is ``crashed`` (``timeout`` when the
    worker killed itself at the run's time limit). On Ctrl-C the workers are
    killed at once.
    """
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    if backend == "fork" and fork_unsafe_modules():
        backend = "loky"  # their thread pools do not survive a fork: a forked worker would hang
    if backend == "fork":
        context = multiprocessing.get_context("fork")

        def pool_of(n: int):
            return ProcessPoolExecutor(n, mp_context=context, initializer=worker_start, initargs=(os.getpid(),))

        def submit(pool, chunk):
            return pool.submit(_run_chunk_forked, chunk)

        _FORKED.append((study, limits))
    else:

        def pool_of(n: int):
            return _loky_pool(n)

        def submit(pool, chunk):
            return pool.submit(_run_chunk_in_worker, study, chunk, limits)

    markers = limits[1] if limits else None
    suspects: list[Run] = []
    remaining: Iterator[Run] | None = runs
    try:
        while remaining is not None:
            planner = plan(remaining, total)
            pool = pool_of(n_jobs)
            in_flight: dict = {}
            try:
                while True:
                    while len(in_flight) < 2 * n_jobs and (chunk := planner.take()) is not None:
                        in_flight[submit(pool, chunk)] = chunk
                    if not in_flight:
                        break
                    done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                    for fut in done:
                        index, rows = fut.result()  # BrokenProcessPool when a worker died
                        write(planner.returned(index), rows)
                        del in_flight[fut]
                remaining = None
            except BrokenProcessPool:
                suspects += [r for chunk in planner.handed.values() for r in chunk]
                remaining, total = planner.rest()
                _shutdown(pool, kill=True)
            except BaseException:
                _shutdown(pool, kill=True)
                raise
            else:
                if backend == "fork":
                    _shutdown(pool, kill=False)
        for run in suspects:  # each alone, in a new one-worker pool
            if _timed_out(markers, run):
                write([run], [_timeout_row(study, run, limits)])
                continue
            pool = pool_of(1)
            try:
                rows = submit(pool, (0, [run])).result()[1]
            except BrokenProcessPool:
                rows = [_timeout_row(study, run, limits) if _timed_out(markers, run) else _crash_row(study, run)]
                _shutdown(pool, kill=True)
            except BaseException:
                _shutdown(pool, kill=True)
                raise
            else:
                if backend == "fork":
                    _shutdown(pool, kill=False)
            write([run], rows)
    finally:
        if backend == "fork":
            _FORKED.pop()


def _shutdown(pool, kill: bool) -> None:
    """Shut a pool down; ``kill``: its workers first (a run in progress, or hung, is not waited for)."""
    if kill:
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            with contextlib.suppress(Exception):
                proc.kill()
    with contextlib.suppress(Exception):
        if hasattr(pool, "_flags"):  # loky's executor
            pool.shutdown(wait=not kill, kill_workers=kill)
        else:
            pool.shutdown(wait=not kill, cancel_futures=True)


def _timed_out(markers: Path | None, run: Run) -> bool:
    """True when a worker killed itself at ``run``'s time limit (and left a marker; it is removed)."""
    if markers is None:
        return False
    marker = markers / run.run_id
    if marker.exists():
        marker.unlink(missing_ok=True)
        return True
    return False


def _timeout_row(study: Study, run: Run, limits: Limits) -> dict:
    row = {f: None for f in study.result_fields}
    row.update(run_id=run.run_id, status="timeout", error=_timeout_message(limits[0] if limits else None), wall_s=None)
    return row


def _crash_row(study: Study, run: Run) -> dict:
    print(f"kvfast: run {run.run_id} killed its worker, twice; stored as crashed", file=sys.stderr)
    row = {f: None for f in study.result_fields}
    row.update(run_id=run.run_id, status="crashed", error=CRASH_MESSAGE, wall_s=None)
    return row


def _dask_client(n_jobs: int, scheduler: str | None):
    """A connected ``distributed.Client`` (and the LocalCluster it owns, or ``None``)."""
    try:
        from distributed import Client
    except ImportError:
        raise ValueError("--backend: 'dask' needs the dask extra; install kvfast[dask]") from None
    import logging

    # kvfast reports dead workers and a lost scheduler itself, in one line: not distributed's tracebacks
    for name in ["distributed", *logging.root.manager.loggerDict]:
        if name.startswith("distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    if scheduler:
        try:
            return Client(scheduler, timeout="5s"), None
        except (OSError, TimeoutError, ValueError) as exc:
            raise ValueError(f"--scheduler: cannot connect to {scheduler!r} ({exc})") from None
    on_main = threading.current_thread() is threading.main_thread()
    # the cluster's processes inherit an ignored SIGINT: Ctrl-C is this process's to handle (it closes them)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if on_main else None
    try:
        cluster = _local_cluster(n_jobs)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return Client(cluster), cluster


def _local_cluster(n_jobs: int):
    import logging

    import dask
    from distributed import LocalCluster

    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        cluster = LocalCluster(
            n_workers=n_jobs,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            silence_logs=logging.CRITICAL,
        )
    return cluster


def _run_chunk_packed(study: Study, packed: bytes) -> bytes:
    worker_start()
    chunk, limits = pickle.loads(packed)
    return pickle.dumps(run_chunk(study, chunk, limits), protocol=pickle.HIGHEST_PROTOCOL)


def _dask_rows(fut) -> list[dict] | None:
    """The rows of a finished chunk, or ``None`` when its worker died (``KilledWorker``: the future may
    say "finished" and still raise) or the task was otherwise lost."""
    if fut.status != "finished":
        return None
    try:
        return pickle.loads(fut.result())[1]
    except Exception:  # noqa: BLE001 - KilledWorker and the like: the chunk is retried run by run
        return None


def _scheduler_gone(client, fut=None, exc: BaseException | None = None) -> bool:
    """True when the futures were cancelled under us: the scheduler died (or the client lost it)."""
    if exc is not None and type(exc).__name__ in ("FuturesCancelledError", "CancelledError", "CommClosedError"):
        return True
    return (fut is not None and fut.status == "cancelled") or client.status != "running"


def _execute_dask(
    study: Study, runs: Iterator[Run], total: int, client, workers: int, plan: Callable, stall_s: float, write, limits
) -> tuple[list[str], str]:
    """Drive Dask futures directly, about two chunks per worker in flight.

    Returns the ids of runs lost (not stored: no chunk finished for ``stall_s``
    seconds, or the scheduler was lost) and why, in a few words ("" if none).
    A chunk whose worker died is re-run one run at a time; a run whose worker
    dies again is ``crashed`` (``timeout`` if the worker killed itself at the
    run's time limit).
    """
    from distributed import wait

    token = os.urandom(4).hex()
    planner = plan(runs, total)
    in_flight: dict = {}
    markers = limits[1] if limits else None

    def submit() -> None:
        while len(in_flight) < 2 * workers and (chunk := planner.take()) is not None:
            packed = pickle.dumps((chunk, limits), protocol=pickle.HIGHEST_PROTOCOL)
            fut = client.submit(_run_chunk_packed, study, packed, key=f"kvfast-{token}-{chunk[0]}", pure=False)
            in_flight[fut] = chunk

    def lost_all(reason: str) -> tuple[list[str], str]:
        lost = [r.run_id for _, chunk in in_flight.values() for r in chunk] + [r.run_id for r in planner.rest()[0]]
        with contextlib.suppress(Exception):
            client.cancel(list(in_flight))
        return lost + [r.run_id for r in suspects], reason

    suspects: list[Run] = []
    try:
        submit()
        while in_flight:
            try:
                done, _ = wait(list(in_flight), timeout=stall_s, return_when="FIRST_COMPLETED")
            except TimeoutError:
                return lost_all(f"no run finished for {stall_s:g} s (--stall-timeout)")
            for fut in done:
                if _scheduler_gone(client, fut):
                    return lost_all("the Dask scheduler was lost")
                index, chunk = in_flight.pop(fut)
                planner.returned(index)
                rows = _dask_rows(fut)
                if rows is None:
                    suspects += chunk
                else:
                    write(chunk, rows)
            submit()
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - a lost scheduler shows as many exception types
        if _scheduler_gone(client, exc=exc):
            return lost_all(f"the Dask scheduler was lost ({type(exc).__name__})")
        raise
    lost: list[str] = []
    for i, run in enumerate(suspects):  # each alone
        try:
            packed = pickle.dumps(((0, [run]), limits), protocol=pickle.HIGHEST_PROTOCOL)
            fut = client.submit(_run_chunk_packed, study, packed, key=f"kvfast-{token}-solo-{run.run_id}", pure=False)
            with contextlib.suppress(TimeoutError):
                wait([fut], timeout=stall_s)
        except Exception as exc:  # noqa: BLE001
            if _scheduler_gone(client, exc=exc):
                return lost + [r.run_id for r in suspects[i:]], f"the Dask scheduler was lost ({type(exc).__name__})"
            raise
        rows = _dask_rows(fut)
        if rows is not None:
            write([run], rows)
        elif fut.status == "error":  # the worker died again, or the task could not run
            write([run], [_timeout_row(study, run, limits) if _timed_out(markers, run) else _crash_row(study, run)])
        elif _scheduler_gone(client, fut):
            return lost + [r.run_id for r in suspects[i:]], "the Dask scheduler was lost"
        else:
            with contextlib.suppress(Exception):
                client.cancel([fut])
            lost.append(run.run_id)
    return lost, (f"no run finished for {stall_s:g} s (--stall-timeout)" if lost else "")


def _progress(total: int, desc: str, quiet: bool):
    from tqdm import tqdm

    disable = quiet or not sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit="run", disable=disable, dynamic_ncols=True, smoothing=0.1)


def run_sweep(
    grid: Grid,
    out: str | os.PathLike,
    *,
    jobs: int | None = None,
    backend: str = "fork",
    scheduler: str | None = None,
    retry_errors: bool = False,
    fresh: bool = False,
    quiet: bool = False,
    chunk_s: float = 0.5,
    chunk_size: int | None = None,
    stall_s: float = 300.0,
    run_timeout: float | None = None,
    max_memory: int | None = None,
) -> SweepReport:
    """Run ``grid`` into the results directory ``out`` (see the module docstring for the contract).

    ``jobs`` above the machine's core count is capped to it with a warning.
    ``run_timeout``: seconds a run may take (a ``timeout`` row after that).
    Raises ``ValueError`` for bad arguments or a results directory that cannot
    be used (one line, nothing stored touched), :class:`StorageError` when
    results cannot be written (disk full): what is stored is kept.
    """
    import joblib

    if backend not in BACKENDS:
        raise ValueError(f"--backend: {backend!r} is not allowed; allowed: {', '.join(BACKENDS)}")
    if backend == "fork":
        import multiprocessing

        # Linux only: Windows has no fork, and macOS system libraries are not fork-safe
        if not sys.platform.startswith("linux") or "fork" not in multiprocessing.get_all_start_methods():
            backend = "loky"
    if jobs is None:
        jobs = joblib.cpu_count()
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"--jobs: {jobs!r} is not allowed; allowed: an integer >= 1")
    cores = joblib.cpu_count()
    if jobs > cores and not (backend == "dask" and scheduler):
        print(f"warning: --jobs {jobs} is more than the {cores} cores here; using {cores}", file=sys.stderr)
        jobs = cores
    if run_timeout is not None and (isinstance(run_timeout, bool) or not run_timeout > 0):
        raise ValueError(f"--run-timeout: {run_timeout!r} is not allowed; allowed: a number of seconds > 0")
    if scheduler and backend != "dask":
        raise ValueError(f"--scheduler: {scheduler!r} needs --backend dask (backend is {backend!r})")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size: {chunk_size!r} is not allowed; allowed: an integer >= 1")
    study = grid.study
    check_memory(grid, max_memory)
    check_disk(grid, out)
    store = ResultsDir(out)
    store.require_writable(study, fresh=fresh)
    t_start = time.perf_counter()
    client = cluster = None
    if backend == "dask" and (jobs > 1 or scheduler):
        client, cluster = _dask_client(jobs, scheduler)
    limits = (run_timeout, store.path / TIMEOUTS) if run_timeout else None
    on_main = threading.current_thread() is threading.main_thread()
    old_handler = signal.signal(signal.SIGINT, on_sigint) if on_main else None
    INTERRUPTED.clear()
    try:
        with store.locked(), _storage_errors(store):
            return _sweep_locked(
                grid,
                store,
                jobs,
                backend,
                client,
                retry_errors,
                fresh,
                quiet,
                chunk_s,
                chunk_size,
                stall_s,
                t_start,
                limits,
            )
    finally:
        if old_handler is not None:
            signal.signal(signal.SIGINT, old_handler)
        with contextlib.suppress(Exception):  # a lost scheduler: closing may fail too
            if client is not None:
                client.close(timeout=5)
            if cluster is not None:
                cluster.close(timeout=5)


_STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO}


@contextlib.contextmanager
def _storage_errors(store: ResultsDir) -> Iterator[None]:
    """Turn a failed write (disk full, quota, read-only file system) into one :class:`StorageError` line."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in _STORAGE_ERRNOS:
            raise
        try:
            stored = f"{len(store.stored_index()):,} runs are stored"
        except Exception:  # noqa: BLE001 - the count is a courtesy
            stored = "what was stored is kept"
        raise StorageError(
            f"{store.path}: cannot write results ({exc.strerror}); {stored}; free space and rerun to resume"
        ) from None


def _warn_versions(store: ResultsDir, old: dict | None, stored: int) -> None:
    """Warn when stored rows were written under other versions of kvfast, NumPy or Numba."""
    if not old or not stored:
        return
    now = versions()
    was = old.get("versions") if isinstance(old.get("versions"), dict) else {}
    changed = [f"{k} {was.get(k)} -> {now[k]}" for k in ("kvfast", "numpy", "numba") if was.get(k) != now.get(k)]
    if changed:
        print(
            f"warning: {store.path}: {stored:,} stored runs were written under other versions "
            f"({', '.join(changed)}); the manifest's history keeps each sweep's versions",
            file=sys.stderr,
        )


def _part_metadata(grid: Grid) -> dict[str, str]:
    """What ``kvfast repair`` needs to rebuild a manifest, written into every part."""
    import json

    study = grid.study
    return {
        "kvfast.format": FORMAT,
        "kvfast.study": study.name,
        "kvfast.study_version": study.version,
        "kvfast.study_ref": grid.study_ref or study.name,
        "kvfast.grid_name": grid.name,
        "kvfast.grid": json.dumps(grid.spec, sort_keys=True, default=str),
        "kvfast.versions": json.dumps(versions(), sort_keys=True),
    }


class _Pending(NamedTuple):
    """What a sweep must run: ``total`` runs, found by looking the grid's ids up in the stored ones."""

    total: int
    mask: np.ndarray | None  # one flag per grid run, in expansion order: pending; None: every run
    skipped_counts: dict[str, int]  # status -> grid runs not re-run, by their stored status
    retried: set[str]  # ids of pending runs that have a stored row (error/crashed with retry_errors)
    retried_counts: dict[str, int]


_BATCH = 1 << 14


def _find_pending(grid: Grid, stored: StoredIndex, redo: tuple[str, ...]) -> _Pending:
    """One pass over the grid's ids (no configs built): which runs are pending, and the stored statuses."""
    if not len(stored):
        return _Pending(len(grid), None, {}, set(), {})
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
    names = dict(enumerate(STATUSES))
    return _Pending(
        int(mask.sum()),
        mask,
        {names[i]: int(n) for i, n in enumerate(skipped) if n},
        retried,
        {names[i]: int(n) for i, n in enumerate(retried_counts) if n},
    )


def _flags(mask: np.ndarray) -> Iterator[bool]:
    for start in range(0, len(mask), _BATCH):
        yield from mask[start : start + _BATCH].tolist()


def _pending_runs(grid: Grid, plan: _Pending) -> Iterator[Run]:
    """The grid's pending runs, in expansion order, generated lazily (no id computed for the others)."""
    return grid.iter_runs(None if plan.mask is None else _flags(plan.mask))


def _sweep_locked(
    grid, store, jobs, backend, client, retry_errors, fresh, quiet, chunk_s, chunk_size, stall_s, t_start, limits
) -> SweepReport:
    study = grid.study
    store.remove_temporaries()
    if fresh:
        store.clear()
    old = store.manifest()
    stored = store.stored_index()
    _warn_versions(store, old, len(stored))
    store.part_metadata = _part_metadata(grid)
    redo = ("error", "crashed", "timeout") if retry_errors else ()
    plan = _find_pending(grid, stored, redo)
    manifest = new_manifest(study, old)
    manifest.update(
        grid=grid.spec, grid_name=grid.name, grid_hash=grid.spec_hash, grid_runs=len(grid), study_ref=grid.study_ref
    )
    store.write_manifest(manifest)

    report = SweepReport(study.name, store.path, len(grid), len(grid) - plan.total, workers=jobs)
    progress = _progress(plan.total, study.name, quiet)
    writer = _Writer(store, study, progress)
    writer.watch = plan.retried
    try:
        if plan.total:
            crashed = stored.ids_with(STATUSES.index("crashed")) | stored.ids_with(STATUSES.index("timeout"))
            pending = _pending_runs(grid, plan)
            _execute(
                study,
                pending,
                plan.total,
                writer,
                report,
                jobs,
                backend,
                client,
                chunk_s,
                chunk_size,
                stall_s,
                crashed,
                limits,
            )
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        try:
            writer.flush()
        finally:
            progress.close()
    if not report.interrupted:
        store.compact(schema_for(study))
    counts = {s: plan.skipped_counts.get(s, 0) + writer.counts.get(s, 0) for s in STATUSES}
    # pending runs with a stored row that were not written now (lost, interrupted) keep their stored status
    for s, n in plan.retried_counts.items():
        counts[s] += n
    for rid in writer.written:
        counts[STATUSES[int(stored.lookup([rid])[0])]] -= 1
    report.counts = counts
    report.ran = writer.ran
    report.compute_s = writer.compute_s
    report.wall_s = time.perf_counter() - t_start
    manifest["history"].append(
        {
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "grid_name": grid.name,
            "grid_hash": grid.spec_hash,
            "grid_runs": len(grid),
            "ran": report.ran,
            "backend": backend,
            "workers": jobs,
            "wall_s": round(report.wall_s, 3),
            "counts": report.counts,
            "lost": len(report.lost),
            "versions": manifest["versions"],
            "interrupted": report.interrupted,
        }
    )
    store.write_manifest(manifest)
    return report


def _execute(
    study, pending, total, writer, report, jobs, backend, client, chunk_s, chunk_size, stall_s, crashed, limits
) -> None:
    if jobs == 1 and client is None:  # in-process, no pool
        size = chunk_size or 64
        while chunk := list(itertools.islice(pending, size)):
            writer(chunk, run_chunk(study, (0, chunk), limits)[1])
        report.chunk_size = size
        return
    # Warm-up: one run in this process compiles (or loads Numba's cache) before any worker starts. Never
    # a run that has killed a process: one stored as crashed, or one that killed this process during an
    # earlier warm-up (its id is left in .warmup). Those go to workers.
    marker = writer.store.path / WARMUP
    avoid = crashed | {marker.read_text().strip() if marker.exists() else ""}
    skipped: list[Run] = []
    local: list[Run] = []
    for run in pending:
        if run.run_id in avoid:
            skipped.append(run)
            if len(skipped) < 64:
                continue
        else:
            local.append(run)
        break
    rest = itertools.chain(skipped, pending)
    # Meanwhile the loky pool starts and its workers import the study (not its kernels: those load
    # from the cache this warm-up fills).
    preheat = None
    if client is None and backend == "loky" and total > 1:
        preheat = threading.Thread(target=_preheat, args=(study, jobs), daemon=True)
        preheat.start()
    elif client is not None and total > 1:  # Dask workers import the engine and the study meanwhile
        preheat = threading.Thread(target=_preheat_dask, args=(client, study), daemon=True)
        preheat.start()
    try:
        for run in local:
            marker.write_text(run.run_id)
            writer([run], [_run_one(study, run, limits)])
    finally:
        if preheat is not None:
            preheat.join()
    marker.unlink(missing_ok=True)
    writer.recent.clear()  # the warm-up's time includes compiling: not a run's time
    total -= len(local)
    if not total:
        return
    workers = jobs
    if client is not None:
        workers = max(1, len(client.scheduler_info().get("workers", {})) or jobs)
    report.workers = workers
    planners: list[_Planner] = []

    def plan(runs: Iterator[Run], n: int) -> _Planner:
        planners.append(_Planner(runs, n, workers, chunk_s, chunk_size, writer.recent))
        return planners[-1]

    if client is not None:
        report.lost, report.lost_reason = _execute_dask(
            study, rest, total, client, workers, plan, stall_s, writer, limits
        )
    elif backend == "threading":
        _execute_threads(study, rest, total, jobs, plan, writer, limits)
    else:
        _execute_pool(study, rest, total, backend, jobs, plan, writer, limits)
    report.chunk_size = max((p.largest for p in planners), default=0)  # the steady-state size
