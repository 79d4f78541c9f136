"""Backends: how chunks of runs reach workers. One module per backend, one contract.

Every backend module has ``execute(job, runs, total) -> Outcome``: run ``total`` runs from the iterator
``runs`` (cut into chunks by ``job.planner``) and hand every finished chunk's rows to ``job.write(runs,
rows)``, from the calling thread. Each run's row is made by :mod:`kvfast.sweep.rows`. A run that raises is an
``error`` row; a chunk whose worker dies is re-run one run at a time, each alone in a worker, and a run that
kills its worker again is a ``crashed`` row (``timeout`` if the worker was killed at the run's time limit).
``KeyboardInterrupt`` (the user's Ctrl-C) stops the workers at once and propagates. The :class:`Outcome`
says how many workers ran the chunks and the largest chunk, and names the runs that ended with no row (Dask:
a stall, a lost scheduler; the other backends lose none).

Here: :func:`execute_serial` (``--jobs 1``: this process, no pool) and :func:`execute_threads` (joblib's
threading backend); modules: :mod:`.pool` (``fork`` and ``loky`` process pools), :mod:`.dask` (Dask futures,
driven directly).
"""

from __future__ import annotations

import importlib
import itertools
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from kvfast.sweep.grid import GridRun
from kvfast.sweep.plan import Planner
from kvfast.sweep.rows import NO_LIMITS, RunLimits, run_chunk

if TYPE_CHECKING:
    from kvfast.sweep.study import Study


class Outcome(NamedTuple):
    """What a backend did: ``workers`` that ran the chunks (a Dask cluster's own count), the largest chunk
    handed out (the steady-state size), the ids of runs lost and why in a few words (``""`` if none), and what
    each Dask worker runs (address -> kvfast, the study's version, ``refused``), for the manifest."""

    workers: int
    chunk_size: int
    lost: tuple[str, ...] = ()
    reason: str = ""
    worker_versions: dict[str, dict] | None = None


@dataclass(frozen=True)
class Job:
    """What a backend needs to execute a sweep's runs.

    ``backend``: the backend's name (``serial``, ``fork``, ``loky``, ``threading``, ``dask``); ``jobs``: the
    sweep's resolved ``--jobs``; ``client``: the Dask client, if any; ``recent``: the wall times of the last
    ``ok`` runs (the writer fills it; planners read it).
    """

    study: Study
    backend: str
    jobs: int
    write: Callable[[Sequence[GridRun], list[dict]], None]
    recent: deque
    limits: RunLimits = NO_LIMITS
    chunk_s: float = 0.5
    chunk_size: int | None = None
    stall_s: float = 300.0
    client: Any = None

    def planner(self, runs: Iterator[GridRun], total: int, workers: int | None = None) -> Planner:
        """A new :class:`Planner` over ``runs`` (``total`` of them) for ``workers`` (default ``jobs``)."""
        return Planner(runs, total, workers or self.jobs, self.chunk_s, self.chunk_size, self.recent)


SERIAL_CHUNK = 64


def execute_serial(job: Job, runs: Iterator[GridRun], total: int) -> Outcome:
    """``--jobs 1``: every run in the sweep's own process, in chunks of ``job.chunk_size`` (default
    :data:`SERIAL_CHUNK`), each chunk's rows written; no pool. A run that kills the process ends the sweep (a rerun
    resumes it); a time limit interrupts Python code and sleeps (``SIGALRM``) but not a run stuck in C code."""
    size = job.chunk_size or SERIAL_CHUNK
    while chunk := list(itertools.islice(runs, size)):
        job.write(chunk, run_chunk(job.study, (0, chunk), job.limits)[1])
    return Outcome(workers=1, chunk_size=size)


def execute_threads(job: Job, runs: Iterator[GridRun], total: int) -> Outcome:
    """``--backend threading``: chunks fanned out to ``job.jobs`` threads of the sweep's process (joblib's
    threading backend), two chunks per thread dispatched ahead. A time limit interrupts a run's Python code only:
    a thread cannot be killed, so a run blocked in C code (a sleep, a Numba kernel) runs until it returns. There
    is no worker process to lose: a run that kills the process ends the sweep."""
    from joblib import Parallel, delayed

    planner = job.planner(runs, total)
    tasks = (delayed(run_chunk)(job.study, chunk, job.limits) for chunk in iter(planner.take, None))
    parallel = Parallel(n_jobs=job.jobs, backend="threading", batch_size=1, return_as="generator_unordered")
    with warnings.catch_warnings():  # joblib's note about tasks cancelled by an interrupt
        warnings.filterwarnings("ignore", message=".*tasks have been successfully executed")
        for index, rows in parallel(tasks):
            job.write(planner.returned(index), rows)
    return Outcome(workers=job.jobs, chunk_size=planner.largest)


def execute(job: Job, runs: Iterator[GridRun], total: int) -> Outcome:
    """Run ``runs`` with ``job.backend`` (see the module docstring for the contract); the process pools' and Dask's
    modules are imported on first use (Dask only when asked for)."""
    here = {"serial": execute_serial, "threading": execute_threads}
    if job.backend in here:
        return here[job.backend](job, runs, total)
    module = importlib.import_module(f"{__name__}.{'dask' if job.backend == 'dask' else 'pool'}")  # fork, loky: pool
    return module.execute(job, runs, total)
