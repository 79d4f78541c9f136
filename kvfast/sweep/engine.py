"""Running a grid: the orchestration. Every job is in its own module; this one calls them in order.

:func:`run_sweep` takes a grid, a results directory and one
:class:`~kvfast.sweep.options.SweepOptions` (built once: by ``kvfast run``, or
here from keyword options), then:

1. checks the grid against the machine (:mod:`kvfast.sweep.limits`) and the
   results directory (:mod:`kvfast.sweep.store`), starts a Dask client if asked;
2. under the directory's lock: finds the pending runs (:mod:`kvfast.sweep.plan`),
   writes the manifest, runs one pending run here first (the warm-up: Numba
   compiles, or loads its cache, once, before workers start; forked workers inherit it),
   then hands the rest to the backend's ``execute`` (:mod:`kvfast.sweep.backends`): rows go to
   the writer (:mod:`kvfast.sweep.writer`);
3. compacts the parts, records the sweep in the manifest's history, returns a :class:`SweepReport`.

Contract of :func:`run_sweep`:

- Everything is validated (backend, jobs, output directory, Dask scheduler)
  before the first run; a problem is a ``ValueError`` and nothing stored is touched.
- Only runs not stored with ``status="ok"`` run (``retry_errors``: also those
  stored as ``error``/``crashed``/``timeout``; ``fresh``: stored results are deleted first).
- A run that raises is an ``error`` row, a run past ``run_timeout`` a ``timeout``
  row, a run that kills its worker twice a ``crashed`` row (:mod:`kvfast.sweep.rows`);
  the sweep goes on. Workers die with the sweep process and ignore SIGINT; Ctrl-C
  kills them and the report says ``interrupted``.
- A failed write (disk full) is a :class:`~kvfast.sweep.store.StorageError`
  saying how many runs are stored.
- Finished chunks are written as a part within about a second (or
  every :data:`~kvfast.sweep.store.PART_ROWS` rows), so an interrupted sweep loses
  only chunks in flight; at the end the parts are compacted.
- The grid is never materialised: memory is bounded by the chunks in flight.
- A run's numbers depend only on its config, never on backend, worker count,
  chunking or completion order.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from kvfast.runtime import INTERRUPTED, on_sigint
from kvfast.sweep.backends import Job, execute
from kvfast.sweep.grid import Grid, GridRun, as_grid
from kvfast.sweep.limits import check_disk, check_memory
from kvfast.sweep.options import BACKENDS, SweepOptions  # noqa: F401 - BACKENDS: kvfast.sweep's, from here
from kvfast.sweep.plan import Pending, find_pending, pending_runs, split_warmup
from kvfast.sweep.progress import meter, runs_per_second
from kvfast.sweep.provenance import changes, provenance
from kvfast.sweep.rows import RunLimits, run_one
from kvfast.sweep.store import (
    FORMAT,
    STATUSES,
    STORAGE_ERRNOS,
    TIMEOUTS,
    WARMUP,
    ResultsDir,
    StorageError,
    StoredIndex,
    new_manifest,
    schema_for,
    utc_now,
    versions,
)
from kvfast.sweep.writer import Writer


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
    worker_versions: dict[str, dict] = field(default_factory=dict)  # Dask: worker address -> its versions

    @property
    def ok(self) -> bool:
        """True when every run of the grid is stored with status ``ok``."""
        return not self.lost and not self.interrupted and self.counts.get("ok", 0) == self.total

    def line(self) -> str:
        """A one-line summary."""
        rate = runs_per_second(self.ran, self.wall_s)
        counts = ", ".join(f"{s} {self.counts.get(s, 0):,}" for s in STATUSES)
        text = (
            f"{self.study}: {self.total:,} runs in the grid, {self.skipped:,} already stored, "
            f"{self.ran:,} run now in {self.wall_s:.1f} s ({rate} runs/s, {self.workers} workers); "
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


def run_sweep(grid: Grid, out: str | os.PathLike, options: SweepOptions | None = None, **kwargs) -> SweepReport:
    """Run ``grid`` into the results directory ``out`` (see the module docstring for the contract).

    ``options``: a :class:`SweepOptions`; or, without it, the same options as
    keywords (``jobs``, ``backend``, ``scheduler``, ``retry_errors``, ``fresh``,
    ``quiet``, ``chunk_s``, ``chunk_size``, ``stall_s``, ``run_timeout``,
    ``max_memory``), checked by :meth:`SweepOptions.build`: ``jobs`` above the
    machine's core count is capped to it with a warning; ``run_timeout``: seconds
    a run may take (a ``timeout`` row after that). Raises ``ValueError`` for bad
    options or a results directory that cannot be used (one line, nothing stored
    touched), :class:`StorageError` when results cannot be written (disk full):
    what is stored is kept. ``out`` is made absolute first, before any run: a run that changes the
    working directory cannot move where results go.
    """
    if options is None:
        options = SweepOptions.build(**kwargs)
    elif kwargs:
        raise TypeError(f"run_sweep: pass options or keywords, not both (got {', '.join(sorted(kwargs))})")
    out = Path(os.path.abspath(out))  # once, before any run: a run that changes directory cannot move it
    check_memory(grid, options.max_memory)
    check_disk(grid, out)
    store = ResultsDir(out, option="--out")
    store.require_writable(grid.study, fresh=options.fresh)
    t_start = time.perf_counter()
    client = cluster = None
    if options.backend == "dask" and (options.jobs > 1 or options.scheduler):
        from kvfast.sweep.backends.dask import dask_client

        client, cluster = dask_client(options.jobs, options.scheduler)
    on_main = threading.current_thread() is threading.main_thread()
    old_handler = signal.signal(signal.SIGINT, on_sigint) if on_main else None
    INTERRUPTED.clear()
    try:
        with store.locked(), _storage_errors(store):
            return _sweep_locked(grid, store, options, client, t_start)
    finally:
        if old_handler is not None:
            signal.signal(signal.SIGINT, old_handler)
        with contextlib.suppress(Exception):  # a lost scheduler: closing may fail too
            if client is not None:
                client.close(timeout=5)
            if cluster is not None:
                cluster.close(timeout=5)


@contextlib.contextmanager
def _storage_errors(store: ResultsDir) -> Iterator[None]:
    """Turn a failed write (disk full, quota, read-only file system) into one :class:`StorageError` line."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in STORAGE_ERRNOS:
            raise
        try:
            stored = f"{len(store.stored_index()):,} runs are stored"
        except Exception:  # noqa: BLE001 - the count is a courtesy
            stored = "what was stored is kept"
        raise StorageError(
            f"{store.path}: cannot write results ({exc.strerror}); {stored}; free space and rerun to resume"
        ) from None


def _warn_changes(store: ResultsDir, old: dict | None, stored: int, provenance_now: dict) -> None:
    """Warn when stored rows were written under other versions of kvfast, NumPy or Numba, or by other code (kvfast's
    commit, the study module's file or commit: :func:`kvfast.sweep.provenance.changes`). Never refuses."""
    if not old or not stored:
        return
    now = versions()
    was = old.get("versions") if isinstance(old.get("versions"), dict) else {}
    changed = [f"{k} {was.get(k)} -> {now[k]}" for k in ("kvfast", "numpy", "numba") if was.get(k) != now.get(k)]
    changed += changes(old.get("provenance"), provenance_now)
    if changed:
        print(
            f"warning: {store.path}: {stored:,} stored runs were written under other versions or code "
            f"({', '.join(changed)}); the manifest's history keeps each sweep's versions and provenance",
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


def _start(grid: Grid, store: ResultsDir, options: SweepOptions) -> tuple[dict, StoredIndex, Pending]:
    """Clean up, read what is stored, find the pending runs and write the manifest: ``(manifest, stored, pending)``."""
    store.remove_temporaries()
    if options.fresh:
        store.clear()
    old = store.manifest()
    stored = store.stored_index()
    code = provenance(grid)
    _warn_changes(store, old, len(stored), code)
    store.part_metadata = _part_metadata(grid)
    pending = find_pending(grid, stored, options.redo)
    manifest = new_manifest(grid.study, old)
    manifest.update(
        grid=grid.spec,
        grid_name=grid.name,
        grid_hash=grid.spec_hash,
        grid_runs=len(grid),
        study_ref=grid.study_ref,
        provenance=code,
    )
    store.write_manifest(manifest)
    return manifest, stored, pending


def _sweep_locked(grid: Grid, store: ResultsDir, options: SweepOptions, client, t_start: float) -> SweepReport:
    study = grid.study
    manifest, stored, pending = _start(grid, store, options)
    report = SweepReport(study.name, store.path, len(grid), len(grid) - pending.total, workers=options.jobs)
    progress = meter(len(grid), report.skipped, study.name, options.quiet)
    writer = Writer(store, study, progress)
    writer.watch = pending.retried
    try:
        if pending.total:
            crashed = stored.ids_with(STATUSES.index("crashed")) | stored.ids_with(STATUSES.index("timeout"))
            _execute(grid, pending, writer, report, options, client, crashed)
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        try:
            writer.flush()
        finally:
            progress.close()
    if not report.interrupted:
        store.compact(schema_for(study))
    report.counts = _counts(pending, writer, stored)
    report.ran = writer.ran
    report.compute_s = writer.compute_s
    report.wall_s = time.perf_counter() - t_start
    manifest["history"].append(
        {
            "finished": utc_now(),
            "grid_name": grid.name,
            "grid_hash": grid.spec_hash,
            "grid_runs": len(grid),
            "ran": report.ran,
            "backend": options.backend,
            "workers": report.workers,
            "wall_s": round(report.wall_s, 3),
            "counts": report.counts,
            "lost": len(report.lost),
            "versions": manifest["versions"],
            "provenance": manifest["provenance"],
            "interrupted": report.interrupted,
            **({"worker_versions": report.worker_versions} if report.worker_versions else {}),
        }
    )
    store.write_manifest(manifest)
    return report


def _counts(pending: Pending, writer: Writer, stored: StoredIndex) -> dict[str, int]:
    """Status -> runs of the grid stored now: those skipped, those written, and those retried, less the retried
    runs written now (the retried runs not written, lost or interrupted, keep their stored status)."""
    rewritten = Counter(STATUSES[code] for code in stored.lookup(list(writer.written)))
    tallies = (pending.skipped_counts, writer.counts, pending.retried_counts)
    return {s: sum(t.get(s, 0) for t in tallies) - rewritten[s] for s in STATUSES}


def _execute(
    grid: Grid,
    pending: Pending,
    writer: Writer,
    report: SweepReport,
    options: SweepOptions,
    client,
    crashed: set[str],
) -> None:
    """Run the pending runs: in this process (one job), or a warm-up here and the rest on the backend."""
    serial = options.jobs == 1 and client is None
    job = Job(
        study=grid.study,
        backend="serial" if serial else options.backend,
        jobs=options.jobs,
        write=writer,
        recent=writer.recent,
        limits=RunLimits(options.run_timeout, writer.store.path / TIMEOUTS, reap=serial),
        chunk_s=options.chunk_s,
        chunk_size=options.chunk_size,
        stall_s=options.stall_s,
        client=client,
    )
    runs, total = pending_runs(grid, pending), pending.total
    if not serial:
        runs, total = _warm_up(job, runs, total, writer, crashed)
    if not total:
        return
    outcome = execute(job, runs, total)
    report.lost, report.lost_reason = list(outcome.lost), outcome.reason
    report.worker_versions = dict(outcome.worker_versions or {})
    report.workers = outcome.workers
    report.chunk_size = outcome.chunk_size  # the steady-state size


def _warm_up(job: Job, runs: Iterator[GridRun], total: int, writer: Writer, crashed: set[str]) -> tuple:
    """Run the warm-up: one pending run in this process, before any worker starts; ``(runs left, how many)``.

    Never a run that has killed a process: one stored as crashed (or timeout), or one
    that killed this process during an earlier warm-up (its id is left in ``.warmup``).
    Those go to workers. The warm-up's time includes compiling: it is not a run's time
    for chunk sizing.
    """
    marker = writer.store.path / WARMUP
    avoid = crashed | {marker.read_text().strip() if marker.exists() else ""}
    local, rest = split_warmup(runs, avoid)
    limits = job.limits._replace(reap=True)  # no pool has started: what the run leaves is its own
    for run in local:
        marker.write_text(run.run_id)
        writer([run], [run_one(job.study, run, limits)])
    marker.unlink(missing_ok=True)
    writer.recent.clear()
    return rest, total - len(local)


def run_inline(grid: Grid | str | os.PathLike | dict | Iterable[dict], study: str | None = None) -> pd.DataFrame:
    """Run every run of ``grid`` (see :func:`~kvfast.sweep.grid.as_grid`) in this process, in grid order, storing
    nothing (the same parsing, validation and run ids as ``kvfast run``); one row per run.

    Columns: the study's config fields, its result fields, ``run_id`` and
    ``status`` (``"ok"``), as :func:`kvfast.load` gives them for a sweep. A run
    that raises stops the call with its exception.
    """
    g = as_grid(grid, study)
    rows = [{**run.config, **g.study.run(dict(run.config)), "run_id": run.run_id, "status": "ok"} for run in g.runs]
    return pd.DataFrame(rows, columns=[*g.study.config_fields, *g.study.result_fields, "run_id", "status"])
