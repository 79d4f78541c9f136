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
- A run that raises is an ``error`` row (its message in ``error``); the sweep
  goes on. A chunk whose worker dies is re-run one run at a time, each alone
  in a worker; a run that kills its worker again is a ``crashed`` row.
- Finished chunks are written as a part within about a second (or
  every :data:`~kvfast.sweep.store.PART_ROWS` rows), so an interrupted sweep loses
  only chunks in flight; at the end the parts are compacted.
- The grid is never materialised: pending runs are generated from it as chunks
  are handed out, and what is stored is looked up in sorted arrays of ids, so
  memory is bounded by the chunks in flight, not by the grid.
- Dask futures are driven directly (no joblib Dask backend), with a stall
  timeout: if nothing finishes for ``stall_s`` seconds the sweep stops and the
  report lists the lost runs (not stored; the next sweep runs them).
- A run's numbers depend only on its config, never on backend, worker count,
  chunking or completion order.
"""

from __future__ import annotations

import itertools
import math
import os
import pickle
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
from kvfast.sweep.store import PART_ROWS, STATUSES, WARMUP, ResultsDir, StoredIndex, new_manifest, schema_for

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
            text += f"; LOST {len(self.lost):,} runs (not stored; run again to retry): {', '.join(self.lost[:5])}"
            text += " ..." if len(self.lost) > 5 else ""
        if self.interrupted:
            text += "; INTERRUPTED (run again to resume)"
        return text


def _run_one(study: Study, run: Run) -> dict:
    """One run as a row of result + bookkeeping columns (never raises for the run's own errors)."""
    clock = time.perf_counter
    t0 = clock()
    try:
        result = study.run(dict(run.config))
        if type(result) is not dict or result.keys() != study.result_fields.keys():
            _wrong_result(study, result)
        row = dict(result)
        row["run_id"] = run.run_id
        row["status"] = "ok"
        row["error"] = None
    except Exception as exc:  # noqa: BLE001 - every run's failure becomes a row
        row = {f: None for f in study.result_fields}
        last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
        where = f" (at {Path(last[0].filename).name}:{last[0].lineno})" if last else ""
        row.update(run_id=run.run_id, status="error", error=f"{type(exc).__name__}: {exc}{where}")
    row["wall_s"] = clock() - t0
    return row


def _wrong_result(study: Study, result) -> None:
    if not isinstance(result, dict):
        raise TypeError(f"run returned {type(result).__name__}, not a dict")
    if set(result) != set(study.result_fields):
        extra = sorted(set(result) - set(study.result_fields))
        missing = sorted(set(study.result_fields) - set(result))
        raise TypeError(f"run returned wrong columns (missing {missing}, unexpected {extra})")


_WATCHING: list[int] = []


def _watch_parent() -> None:
    """In a pool worker (loky, fork): exit when the sweep process that started it is gone (``kill -9``).

    Idle workers otherwise outlive a hard-killed parent indefinitely.
    """
    import multiprocessing

    if _WATCHING or not multiprocessing.current_process().name.startswith(("LokyProcess", "ForkProcess")):
        return
    parent = os.getppid()
    _WATCHING.append(parent)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="kvfast-watch-parent", daemon=True).start()


def run_chunk(study: Study, chunk: tuple[int, list[Run]]) -> tuple[int, list[dict]]:
    """A worker's task: run every run of one chunk, in order; returns ``(chunk index, rows)``."""
    _watch_parent()
    index, runs = chunk
    return index, [_run_one(study, r) for r in runs]


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
    _watch_parent()
    return os.getpid()


def _preheat(study: Study, jobs: int) -> None:
    """Start the loky pool (the one the sweep then reuses) and import the study in every worker."""
    from joblib import Parallel, delayed

    try:
        Parallel(n_jobs=jobs, backend="loky")(delayed(_loaded)(study) for _ in range(jobs))
    except Exception:  # noqa: BLE001 - only a head start; the sweep itself reports any failure
        pass


def _preheat_dask(client, study: Study) -> None:
    try:
        client.run(_loaded, study)
    except Exception:  # noqa: BLE001 - only a head start
        pass


def _is_crash(exc: BaseException) -> bool:
    from joblib.externals.loky.process_executor import BrokenProcessPool

    return isinstance(exc, BrokenProcessPool)


def _execute_joblib(
    study: Study, runs: Iterator[Run], total: int, backend: str, n_jobs: int, plan: Callable, write: Callable
) -> None:
    """Fan chunks out with joblib; chunks lost to a dead worker are re-run one run at a time, alone."""
    from joblib import Parallel, delayed

    suspects: list[Run] = []
    remaining: Iterator[Run] | None = runs
    while remaining is not None:
        planner = plan(remaining, total)

        def tasks(planner=planner) -> Iterator:
            while (chunk := planner.take()) is not None:
                yield delayed(run_chunk)(study, chunk)

        parallel = Parallel(n_jobs=n_jobs, backend=backend, batch_size=1, return_as="generator_unordered")
        try:
            with warnings.catch_warnings():  # joblib's note about tasks cancelled by an interrupt
                warnings.filterwarnings("ignore", message=".*tasks have been successfully executed")
                for index, rows in parallel(tasks()):
                    write(planner.returned(index), rows)
            remaining = None
        except Exception as exc:
            if not _is_crash(exc):
                raise
            suspects += [r for chunk in planner.handed.values() for r in chunk]
            remaining, total = planner.rest()
    for run in suspects:  # each alone, in a worker process
        try:
            rows = Parallel(n_jobs=2, backend="loky")([delayed(run_chunk)(study, (0, [run]))])[0][1]
        except Exception as exc:
            if not _is_crash(exc):
                raise
            rows = [_crash_row(study, run)]
        write([run], rows)


_FORKED_STUDY: list = []  # the study, as forked workers inherit it (nothing to pickle but the chunks)


def _run_chunk_forked(chunk: tuple[int, list[Run]]) -> tuple[int, list[dict]]:
    return run_chunk(_FORKED_STUDY[-1], chunk)


def _execute_fork(study: Study, runs: Iterator[Run], total: int, n_jobs: int, plan: Callable, write: Callable) -> None:
    """Fan chunks out to a pool of processes forked from this one after its warm-up.

    The workers start in milliseconds: they inherit the imported modules and the
    compiled kernels. About two chunks per worker are in flight. A dead worker
    breaks the pool: the chunks in flight are re-run one run at a time, each alone
    in a new one-worker pool, and a run that kills that worker too is ``crashed``.
    """
    import multiprocessing

    context = multiprocessing.get_context("fork")
    _FORKED_STUDY.append(study)
    try:
        _fork_loop(runs, total, n_jobs, plan, write, context, study)
    finally:
        _FORKED_STUDY.pop()


def _fork_loop(runs, total, n_jobs, plan, write, context, study) -> None:
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    suspects: list[Run] = []
    remaining: Iterator[Run] | None = runs
    while remaining is not None:
        planner = plan(remaining, total)
        pool = ProcessPoolExecutor(n_jobs, mp_context=context, initializer=_watch_parent)
        in_flight: dict = {}
        try:
            while True:
                while len(in_flight) < 2 * n_jobs and (chunk := planner.take()) is not None:
                    in_flight[pool.submit(_run_chunk_forked, chunk)] = chunk
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
        finally:
            pool.shutdown(wait=remaining is None, cancel_futures=True)
    for run in suspects:  # each alone, in a new one-worker pool
        with ProcessPoolExecutor(1, mp_context=context, initializer=_watch_parent) as pool:
            try:
                rows = pool.submit(_run_chunk_forked, (0, [run])).result()[1]
            except BrokenProcessPool:
                rows = [_crash_row(study, run)]
        write([run], rows)


def _crash_row(study: Study, run: Run) -> dict:
    row = {f: None for f in study.result_fields}
    row.update(run_id=run.run_id, status="crashed", error=CRASH_MESSAGE, wall_s=None)
    return row


def _dask_client(n_jobs: int, scheduler: str | None):
    """A connected ``distributed.Client`` (and the LocalCluster it owns, or ``None``)."""
    try:
        import dask
        from distributed import Client, LocalCluster
    except ImportError:
        raise ValueError("--backend: 'dask' needs the dask extra; install kvfast[dask]") from None
    import logging

    if scheduler:
        try:
            return Client(scheduler, timeout="5s"), None
        except (OSError, TimeoutError, ValueError) as exc:
            raise ValueError(f"--scheduler: cannot connect to {scheduler!r} ({exc})") from None
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        cluster = LocalCluster(
            n_workers=n_jobs,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            silence_logs=logging.ERROR,
        )
    return Client(cluster), cluster


def _pack(chunk: tuple[int, list[Run]]) -> bytes:
    """A chunk as one bytes object: Dask then sends it as it is, instead of walking every run's config
    for futures to substitute (the walk cost more than the tiny runs themselves)."""
    return pickle.dumps(chunk, protocol=pickle.HIGHEST_PROTOCOL)


def _run_chunk_packed(study: Study, packed: bytes) -> bytes:
    return pickle.dumps(run_chunk(study, pickle.loads(packed)), protocol=pickle.HIGHEST_PROTOCOL)


def _execute_dask(
    study: Study, runs: Iterator[Run], total: int, client, workers: int, plan: Callable, stall_s: float, write
) -> list:
    """Drive Dask futures directly, about two chunks per worker in flight.

    Returns the ids of runs lost to a stall (no chunk finished for ``stall_s`` seconds).
    """
    from distributed import wait

    token = os.urandom(4).hex()
    planner = plan(runs, total)
    in_flight: dict = {}

    def submit() -> None:
        while len(in_flight) < 2 * workers and (chunk := planner.take()) is not None:
            fut = client.submit(_run_chunk_packed, study, _pack(chunk), key=f"kvfast-{token}-{chunk[0]}", pure=False)
            in_flight[fut] = chunk

    suspects: list[Run] = []
    submit()
    while in_flight:
        try:
            done, _ = wait(list(in_flight), timeout=stall_s, return_when="FIRST_COMPLETED")
        except TimeoutError:
            break
        for fut in done:
            index, chunk = in_flight.pop(fut)
            planner.returned(index)
            if fut.status == "finished":
                write(chunk, pickle.loads(fut.result())[1])
            else:  # the worker died (KilledWorker) or the task was lost
                suspects += chunk
        submit()
    if in_flight:
        lost = [r.run_id for _, chunk in in_flight.values() for r in chunk] + [r.run_id for r in planner.rest()[0]]
        client.cancel(list(in_flight))
        return lost + [r.run_id for r in suspects]
    lost = []
    for run in suspects:  # each alone
        fut = client.submit(run_chunk, study, (0, [run]), key=f"kvfast-{token}-solo-{run.run_id}", pure=False)
        try:
            wait([fut], timeout=stall_s)
        except TimeoutError:
            pass
        if fut.status == "finished":
            write([run], fut.result()[1])
        elif fut.status == "error":
            exc = fut.exception()
            if type(exc).__name__ == "KilledWorker":
                write([run], [_crash_row(study, run)])
            else:  # not the run's own exception (that is caught in the worker): the task could not run
                row = _crash_row(study, run)
                row.update(status="error", error=f"{type(exc).__name__}: {exc}")
                write([run], [row])
        else:
            client.cancel([fut])
            lost.append(run.run_id)
    return lost


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
) -> SweepReport:
    """Run ``grid`` into the results directory ``out`` (see the module docstring for the contract)."""
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
    if scheduler and backend != "dask":
        raise ValueError(f"--scheduler: {scheduler!r} needs --backend dask (backend is {backend!r})")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size: {chunk_size!r} is not allowed; allowed: an integer >= 1")
    study = grid.study
    store = ResultsDir(out)
    store.require_writable(study, fresh=fresh)
    t_start = time.perf_counter()
    client = cluster = None
    if backend == "dask" and (jobs > 1 or scheduler):
        client, cluster = _dask_client(jobs, scheduler)
    try:
        with store.locked():
            return _sweep_locked(
                grid, store, jobs, backend, client, retry_errors, fresh, quiet, chunk_s, chunk_size, stall_s, t_start
            )
    finally:
        if client is not None:
            client.close()
        if cluster is not None:
            cluster.close()


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
    grid, store, jobs, backend, client, retry_errors, fresh, quiet, chunk_s, chunk_size, stall_s, t_start
) -> SweepReport:
    study = grid.study
    store.remove_temporaries()
    if fresh:
        store.clear()
    old = store.manifest()
    stored = store.stored_index()
    redo = ("error", "crashed") if retry_errors else ()
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
            crashed = stored.ids_with(STATUSES.index("crashed"))
            pending = _pending_runs(grid, plan)
            _execute(
                study, pending, plan.total, writer, report, jobs, backend, client, chunk_s, chunk_size, stall_s, crashed
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
            "interrupted": report.interrupted,
        }
    )
    store.write_manifest(manifest)
    return report


def _execute(
    study, pending, total, writer, report, jobs, backend, client, chunk_s, chunk_size, stall_s, crashed: set[str]
) -> None:
    if jobs == 1 and client is None:  # in-process, no pool
        size = chunk_size or 64
        while chunk := list(itertools.islice(pending, size)):
            writer(chunk, run_chunk(study, (0, chunk))[1])
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
            writer([run], [_run_one(study, run)])
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
        report.lost = _execute_dask(study, rest, total, client, workers, plan, stall_s, writer)
    elif backend == "fork":
        _execute_fork(study, rest, total, jobs, plan, writer)
    else:
        _execute_joblib(study, rest, total, backend, jobs, plan, writer)
    report.chunk_size = max((p.largest for p in planners), default=0)  # the steady-state size
