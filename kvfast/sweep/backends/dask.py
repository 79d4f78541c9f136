"""``--backend dask``: chunks as Dask futures, driven directly (not through joblib's Dask backend,
which can wait forever on a task whose worker died).

About two chunks per worker are in flight. Each chunk (and its rows) travels as
one pickled bytes object, so distributed does not walk every run's config looking
for futures. A chunk whose worker died (``KilledWorker``, even on a future that
says "finished") is re-run one run at a time; a run whose worker dies again is
``crashed`` (``timeout`` if the worker killed itself at the run's time limit).
If no chunk finishes for ``job.stall_s`` seconds, or the scheduler is lost, the
sweep stops: the runs not stored are returned as lost, with the reason.

Before the first chunk, every worker says which kvfast it runs and which version of the study its own
import of the study's module gives (:func:`check_workers`); a worker that differs from this process is
refused (one line naming it and both versions; no chunk goes to it), and the sweep stops when none is left.
The manifest's history records each worker's versions.

On the LocalCluster kvfast starts (:func:`dask_client` without a scheduler
address) the scheduler gives up on a task after its first worker death
(``allowed-failures = 0``); its processes ignore SIGINT (Ctrl-C is the sweep's).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvfast.runtime.worker import worker_start
from kvfast.sweep.backends import Job, Outcome
from kvfast.sweep.grid import GridRun
from kvfast.sweep.rows import lost_worker_row, run_chunk
from kvfast.validation import import_extra

if TYPE_CHECKING:
    from kvfast.sweep.study import Study


def dask_client(jobs: int, scheduler: str | None):
    """A connected ``distributed.Client`` (and the LocalCluster it owns, or ``None``); ``ValueError`` if none."""
    Client = import_extra("distributed", "'dask'", "dask", field="--backend").Client
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
        import dask
        from distributed import LocalCluster

        with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
            cluster = LocalCluster(
                n_workers=jobs, threads_per_worker=1, dashboard_address=None, silence_logs=logging.CRITICAL
            )
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return Client(cluster), cluster


def run_chunk_packed(study: Study, packed: bytes) -> bytes:
    """A Dask task: a pickled ``(chunk, limits)`` in, the pickled ``(index, rows)`` out."""
    worker_start()
    chunk, limits = pickle.loads(packed)
    return pickle.dumps(run_chunk(study, chunk, limits), protocol=pickle.HIGHEST_PROTOCOL)


def _rows(fut) -> list[dict] | None:
    """The rows of a finished chunk, or ``None`` when its worker died (``KilledWorker``: the future may
    say "finished" and still raise) or the task was otherwise lost."""
    if fut.status != "finished":
        return None
    try:
        return pickle.loads(fut.result())[1]
    except Exception:  # noqa: BLE001 - KilledWorker and the like: the chunk is retried run by run
        return None


def worker_identity(study_module: str, study_name: str) -> dict:
    """On a worker: the kvfast it runs and the version of study ``study_name`` that its own import of
    ``study_module`` gives (``None`` when the module defines no such study)."""
    import importlib

    import kvfast._version
    from kvfast.sweep.study import Study

    found: dict = {"kvfast": kvfast._version.__version__, "study_version": None}
    try:
        module = importlib.import_module(study_module)
    except BaseException as exc:  # noqa: BLE001 - the client names it
        found["study_version"] = f"its module cannot be imported ({type(exc).__name__})"
        return found
    versions = (
        value.version for value in vars(module).values() if isinstance(value, Study) and value.name == study_name
    )
    found["study_version"] = next(versions, None)
    return found


def check_workers(job: Job) -> tuple[list[str] | None, dict[str, dict]]:
    """Ask every worker for its versions (:func:`worker_identity`); print one line per worker that differs from
    this process; ``(only, versions)``: ``only`` the addresses of the workers that match (``None`` when none was
    refused: any worker may take chunks), ``versions`` each worker's address -> its versions and whether it was refused.
    ``ValueError`` (one line, before any chunk runs) when every worker was refused."""
    import kvfast._version

    study = job.study
    mine = {"kvfast": kvfast._version.__version__, "study_version": study.version}
    found = job.client.run(worker_identity, study.run.__module__, study.name)
    good, refused, versions = [], [], {}
    for address, theirs in sorted(found.items()):
        versions[address] = {**theirs, "refused": theirs != mine}
        if theirs == mine:
            good.append(address)
            continue
        differ = [
            f"{label} {theirs[key]}, this client {label} {mine[key]}"
            for key, label in (("kvfast", "kvfast"), ("study_version", f"study {study.name} version"))
            if theirs[key] != mine[key]
        ]
        refused.append(f"Dask worker {address} refused: it runs {'; '.join(differ)}")
        print(f"kvfast: {refused[-1]}; no run goes to it", file=sys.stderr)
    if refused and not good:  # (no worker at all is not a refusal: the stall limit covers a cluster without any)
        raise ValueError(f"--scheduler: every worker was refused ({refused[0]}); nothing ran on the cluster")
    return good if refused else None, versions


def _scheduler_gone(client, fut=None, exc: BaseException | None = None) -> bool:
    """True when the futures were cancelled under us: the scheduler died (or the client lost it)."""
    if exc is not None and type(exc).__name__ in ("FuturesCancelledError", "CancelledError", "CommClosedError"):
        return True
    return (fut is not None and fut.status == "cancelled") or client.status != "running"


class _Driver:
    """One sweep's futures: submits chunks, collects rows, and names what is lost (``(run ids, why)``).

    ``workers``: how many the cluster has for this sweep; ``only``: the workers chunks may go to (``None``: any;
    set when one was refused)."""

    def __init__(self, job: Job, runs: Iterator[GridRun], total: int, workers: int, only: list[str] | None) -> None:
        self.job = job
        self.client = job.client
        self.token = os.urandom(4).hex()
        self.workers = workers
        self.planner = job.planner(runs, total, workers)
        self.in_flight: dict = {}
        self.suspects: list[GridRun] = []
        self.only = only

    def submit(self, chunk: tuple[int, list[GridRun]], key: str):
        packed = pickle.dumps((chunk, self.job.limits), protocol=pickle.HIGHEST_PROTOCOL)
        where = {"workers": self.only, "allow_other_workers": False} if self.only else {}
        return self.client.submit(run_chunk_packed, self.job.study, packed, key=key, pure=False, **where)

    def top_up(self) -> None:
        while len(self.in_flight) < 2 * self.workers and (chunk := self.planner.take()) is not None:
            self.in_flight[self.submit(chunk, f"kvfast-{self.token}-{chunk[0]}")] = chunk

    def lost_all(self, reason: str) -> tuple[list[str], str]:
        lost = [r.run_id for _, chunk in self.in_flight.values() for r in chunk]
        lost += [r.run_id for r in self.planner.rest()[0]]
        with contextlib.suppress(Exception):
            self.client.cancel(list(self.in_flight))
        return lost + [r.run_id for r in self.suspects], reason

    def run_chunks(self) -> tuple[list[str], str] | None:
        """Every chunk once; a chunk whose worker died goes to ``suspects``. What is lost if it stopped."""
        from distributed import wait

        stall_s = self.job.stall_s
        self.top_up()
        while self.in_flight:
            try:
                done, _ = wait(list(self.in_flight), timeout=stall_s, return_when="FIRST_COMPLETED")
            except TimeoutError:
                return self.lost_all(f"no run finished for {stall_s:g} s (--stall-timeout)")
            for fut in done:
                if _scheduler_gone(self.client, fut):
                    return self.lost_all("the Dask scheduler was lost")
                index, chunk = self.in_flight.pop(fut)
                self.planner.returned(index)
                rows = _rows(fut)
                if rows is None:
                    self.suspects += chunk
                else:
                    self.job.write(chunk, rows)
            self.top_up()
        return None

    def run_suspects(self) -> tuple[list[str], str]:
        """Each run of a chunk whose worker died, alone."""
        from distributed import wait

        job, stall_s, lost = self.job, self.job.stall_s, []
        for i, run in enumerate(self.suspects):
            try:
                fut = self.submit((0, [run]), f"kvfast-{self.token}-solo-{run.run_id}")
                with contextlib.suppress(TimeoutError):
                    wait([fut], timeout=stall_s)
            except Exception as exc:  # noqa: BLE001
                if _scheduler_gone(self.client, exc=exc):
                    why = f"the Dask scheduler was lost ({type(exc).__name__})"
                    return lost + [r.run_id for r in self.suspects[i:]], why
                raise
            rows = _rows(fut)
            if rows is not None:
                job.write([run], rows)
            elif fut.status == "error":  # the worker died again, or the task could not run
                job.write([run], [lost_worker_row(job.study, run, job.limits)])
            elif _scheduler_gone(self.client, fut):
                return lost + [r.run_id for r in self.suspects[i:]], "the Dask scheduler was lost"
            else:
                with contextlib.suppress(Exception):
                    self.client.cancel([fut])
                lost.append(run.run_id)
        return lost, f"no run finished for {stall_s:g} s (--stall-timeout)" if lost else ""


def execute(job: Job, runs: Iterator[GridRun], total: int) -> Outcome:
    """Drive Dask futures directly (see the module docstring); returns the runs lost and why."""
    only, versions = check_workers(job)
    count = len(only) if only is not None else max(1, len(job.client.scheduler_info().get("workers", {})) or job.jobs)
    driver = _Driver(job, runs, total, count, only)
    try:
        lost = driver.run_chunks()
    except Exception as exc:  # noqa: BLE001 - a lost scheduler shows as many exception types
        if not _scheduler_gone(job.client, exc=exc):
            raise
        lost = driver.lost_all(f"the Dask scheduler was lost ({type(exc).__name__})")
    if lost is None:
        lost = driver.run_suspects() if driver.suspects else ([], "")
    return Outcome(driver.workers, driver.planner.largest, tuple(lost[0]), lost[1], versions)
