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
- Each finished chunk is written as a part at once, so an interrupted sweep
  loses only chunks in flight; at the end the parts are compacted into one.
- Dask futures are driven directly (no joblib Dask backend), with a stall
  timeout: if nothing finishes for ``stall_s`` seconds the sweep stops and the
  report lists the lost runs (not stored; the next sweep runs them).
- A run's numbers depend only on its config, never on backend, worker count,
  chunking or completion order.
"""

from __future__ import annotations

import math
import os
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
from typing import TYPE_CHECKING

import pyarrow as pa

from kvfast.sweep.grid import Grid, Run
from kvfast.sweep.store import STATUSES, WARMUP, ResultsDir, new_manifest, schema_for

if TYPE_CHECKING:
    from kvfast.studies.base import Study

BACKENDS = ("loky", "threading", "dask")
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
    t0 = time.perf_counter()
    try:
        result = study.run(dict(run.config))
        if not isinstance(result, dict):
            raise TypeError(f"run returned {type(result).__name__}, not a dict")
        if set(result) != set(study.result_fields):
            extra = sorted(set(result) - set(study.result_fields))
            missing = sorted(set(study.result_fields) - set(result))
            raise TypeError(f"run returned wrong columns (missing {missing}, unexpected {extra})")
        row = dict(result)
        row.update(run_id=run.run_id, status="ok", error=None)
    except Exception as exc:  # noqa: BLE001 - every run's failure becomes a row
        row = {f: None for f in study.result_fields}
        last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
        where = f" (at {Path(last[0].filename).name}:{last[0].lineno})" if last else ""
        row.update(run_id=run.run_id, status="error", error=f"{type(exc).__name__}: {exc}{where}")
    row["wall_s"] = time.perf_counter() - t0
    return row


_WATCHING: list[int] = []


def _watch_parent() -> None:
    """In a loky worker: exit when the sweep process that started it is gone (``kill -9``).

    loky's idle workers otherwise outlive a hard-killed parent indefinitely.
    """
    import multiprocessing

    if _WATCHING or not multiprocessing.current_process().name.startswith("LokyProcess"):
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
    """Turns result rows into Arrow tables of the study's schema and writes parts."""

    def __init__(self, store: ResultsDir, study: Study, configs: dict[str, dict], progress) -> None:
        self.store = store
        self.study = study
        self.schema = schema_for(study)
        self.configs = configs
        self.progress = progress
        self.done: set[str] = set()
        self.ran = 0
        self.errors = 0
        self.compute_s = 0.0
        self.recent: deque = deque(maxlen=64)

    def _full(self, row: dict) -> dict:
        out = dict(self.configs[row["run_id"]])
        out.update(row)
        return out

    def __call__(self, rows: list[dict]) -> None:
        if not rows:
            return
        full = [self._full(r) for r in rows]
        try:
            table = pa.Table.from_pylist(full, schema=self.schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError, ValueError):
            table = pa.concat_tables([self._one_row(r) for r in full])
        self.store.write_part(table)
        for r in rows:
            self.done.add(r["run_id"])
            self.compute_s += r["wall_s"] or 0.0
            if r["status"] == "ok":
                self.recent.append(r["wall_s"])
            self.errors += r["status"] != "ok"
        self.ran += len(rows)
        if self.progress is not None:
            self.progress.update(len(rows))
            self.progress.set_postfix(errors=self.errors, refresh=False)

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
    """Cuts runs into chunks lazily, as workers ask for work.

    A chunk holds about ``chunk_s`` seconds of work, from the median wall time of
    the last runs finished (one run per chunk until a time is known), and no more
    than ``len(runs) / (4 * workers)`` runs, so each worker gets at least four
    chunks and the tail stays balanced. ``fixed`` overrides the size.
    """

    def __init__(self, runs: Sequence[Run], workers: int, chunk_s: float, fixed: int | None, recent: deque) -> None:
        self.runs = list(runs)
        self.pos = 0
        self.chunk_s = chunk_s
        self.fixed = fixed
        self.recent = recent
        self.cap = max(1, math.ceil(len(self.runs) / (4 * workers)))
        self.handed: dict[int, list[Run]] = {}
        self.sizes: list[int] = []

    def size(self) -> int:
        if self.fixed:
            return self.fixed
        times = list(self.recent)
        if not times:
            return 1
        return max(1, min(self.cap, round(self.chunk_s / max(statistics.median(times), 1e-6))))

    def take(self) -> tuple[int, list[Run]] | None:
        """The next chunk ``(index, runs)``, or ``None`` when every run has been handed out."""
        if self.pos >= len(self.runs):
            return None
        chunk = self.runs[self.pos : self.pos + self.size()]
        self.pos += len(chunk)
        index = len(self.handed)
        self.handed[index] = chunk
        self.sizes.append(len(chunk))
        return index, chunk

    def rest(self) -> list[Run]:
        """Runs not handed out yet."""
        return self.runs[self.pos :]


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


def _is_crash(exc: BaseException) -> bool:
    from joblib.externals.loky.process_executor import BrokenProcessPool

    return isinstance(exc, BrokenProcessPool)


def _execute_joblib(study: Study, runs: list[Run], backend: str, n_jobs: int, plan: Callable, write: Callable) -> None:
    """Fan chunks out with joblib; chunks lost to a dead worker are re-run one run at a time, alone."""
    from joblib import Parallel, delayed

    suspects: list[Run] = []
    remaining = runs
    while remaining:
        planner = plan(remaining)
        returned: set[int] = set()

        def tasks(planner=planner) -> Iterator:
            while (chunk := planner.take()) is not None:
                yield delayed(run_chunk)(study, chunk)

        parallel = Parallel(n_jobs=n_jobs, backend=backend, batch_size=1, return_as="generator_unordered")
        try:
            with warnings.catch_warnings():  # joblib's note about tasks cancelled by an interrupt
                warnings.filterwarnings("ignore", message=".*tasks have been successfully executed")
                for index, rows in parallel(tasks()):
                    returned.add(index)
                    write(rows)
            remaining = []
        except Exception as exc:
            if not _is_crash(exc):
                raise
            suspects += [r for i, chunk in planner.handed.items() if i not in returned for r in chunk]
            remaining = planner.rest()
    for run in suspects:  # each alone, in a worker process
        try:
            rows = Parallel(n_jobs=2, backend="loky")([delayed(run_chunk)(study, (0, [run]))])[0][1]
        except Exception as exc:
            if not _is_crash(exc):
                raise
            rows = [_crash_row(study, run)]
        write(rows)


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


def _execute_dask(study: Study, runs: list[Run], client, workers: int, plan: Callable, stall_s: float, write) -> list:
    """Drive Dask futures directly, about two chunks per worker in flight.

    Returns the ids of runs lost to a stall (no chunk finished for ``stall_s`` seconds).
    """
    from distributed import wait

    token = os.urandom(4).hex()
    planner = plan(runs)
    in_flight: dict = {}

    def submit() -> None:
        while len(in_flight) < 2 * workers and (chunk := planner.take()) is not None:
            fut = client.submit(run_chunk, study, chunk, key=f"kvfast-{token}-{chunk[0]}", pure=False)
            in_flight[fut] = chunk

    suspects: list[Run] = []
    submit()
    while in_flight:
        try:
            done, _ = wait(list(in_flight), timeout=stall_s, return_when="FIRST_COMPLETED")
        except TimeoutError:
            break
        for fut in done:
            chunk = in_flight.pop(fut)
            if fut.status == "finished":
                write(fut.result()[1])
            else:  # the worker died (KilledWorker) or the task was lost
                suspects += chunk[1]
        submit()
    if in_flight:
        lost = [r.run_id for chunk in in_flight.values() for r in chunk[1]] + [r.run_id for r in planner.rest()]
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
            write(fut.result()[1])
        elif fut.status == "error":
            exc = fut.exception()
            if type(exc).__name__ == "KilledWorker":
                write([_crash_row(study, run)])
            else:  # not the run's own exception (that is caught in the worker): the task could not run
                row = _crash_row(study, run)
                row.update(status="error", error=f"{type(exc).__name__}: {exc}")
                write([row])
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
    backend: str = "loky",
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


def _sweep_locked(
    grid, store, jobs, backend, client, retry_errors, fresh, quiet, chunk_s, chunk_size, stall_s, t_start
) -> SweepReport:
    study = grid.study
    store.remove_temporaries()
    if fresh:
        store.clear()
    old = store.manifest()
    stored = store.stored_status()
    redo = ("error", "crashed") if retry_errors else ()
    pending = [r for r in grid.runs if r.run_id not in stored or stored[r.run_id] in redo]
    manifest = new_manifest(study, old)
    manifest.update(grid=grid.spec, grid_name=grid.name, grid_hash=grid.spec_hash, grid_runs=len(grid))
    store.write_manifest(manifest)

    report = SweepReport(study.name, store.path, len(grid), len(grid) - len(pending), workers=jobs)
    configs = {r.run_id: r.config for r in pending}
    progress = _progress(len(pending), study.name, quiet)
    writer = _Writer(store, study, configs, progress)
    try:
        if pending:
            crashed = {rid for rid, st in stored.items() if st == "crashed"}
            _execute(grid, pending, writer, report, jobs, backend, client, chunk_s, chunk_size, stall_s, crashed)
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        progress.close()
    if not report.interrupted:
        store.compact(schema_for(study))
    final = store.stored_status()
    report.counts = {s: 0 for s in STATUSES}
    for r in grid.runs:
        if r.run_id in final:
            report.counts[final[r.run_id]] = report.counts.get(final[r.run_id], 0) + 1
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
    grid, pending, writer, report, jobs, backend, client, chunk_s, chunk_size, stall_s, crashed: set[str]
) -> None:
    study = grid.study
    if jobs == 1 and client is None:  # in-process, no pool
        size = chunk_size or 64
        for s in range(0, len(pending), size):
            writer(run_chunk(study, (0, pending[s : s + size]))[1])
        report.chunk_size = size
        return
    # Warm-up: one run in this process compiles (or loads Numba's cache) before any worker starts. Never
    # a run that has killed a process: one stored as crashed, or one that killed this process during an
    # earlier warm-up (its id is left in .warmup). Those go to workers.
    marker = writer.store.path / WARMUP
    avoid = crashed | {marker.read_text().strip() if marker.exists() else ""}
    local = [r for r in pending if r.run_id not in avoid][:1]
    # Meanwhile the loky pool starts and its workers import the study (not its kernels: those load
    # from the cache this warm-up fills).
    preheat = None
    if client is None and backend == "loky" and len(pending) > 1:
        preheat = threading.Thread(target=_preheat, args=(study, jobs), daemon=True)
        preheat.start()
    try:
        for run in local:
            marker.write_text(run.run_id)
            writer([_run_one(study, run)])
    finally:
        if preheat is not None:
            preheat.join()
    marker.unlink(missing_ok=True)
    writer.recent.clear()  # the warm-up's time includes compiling: not a run's time
    rest = [r for r in pending if r not in local]
    if not rest:
        return
    workers = jobs
    if client is not None:
        workers = max(1, len(client.scheduler_info().get("workers", {})) or jobs)
    report.workers = workers
    planners: list[_Planner] = []

    def plan(runs: list[Run]) -> _Planner:
        planners.append(_Planner(runs, workers, chunk_s, chunk_size, writer.recent))
        return planners[-1]

    if client is not None:
        report.lost = _execute_dask(study, rest, client, workers, plan, stall_s, writer)
    else:
        _execute_joblib(study, rest, backend, jobs, plan, writer)
    sizes = [n for p in planners for n in p.sizes]
    report.chunk_size = max(sizes, default=0)  # the steady-state size (the first chunks are single runs)
