"""Backends: how chunks of runs reach workers. One module per backend, one contract.

Every backend module has ``execute(job, runs, total) -> Outcome``: run ``total`` runs from the iterator
``runs`` (cut into chunks by ``job.planner``) and hand every finished chunk's rows to ``job.write(runs,
rows)``, from the calling thread. Each run's row is made by :mod:`kvfast.sweep.rows`. A run that raises is an
``error`` row; a chunk whose worker dies is re-run one run at a time, each alone in a worker, and a run that
kills its worker again is a ``crashed`` row (``timeout`` if the worker was killed at the run's time limit).
``KeyboardInterrupt`` (the user's Ctrl-C) stops the workers at once and propagates. The :class:`Outcome`
says how many workers ran the chunks and the largest chunk, and names the runs that ended with no row (Dask:
a stall, a lost scheduler; the other backends lose none).

The modules: :mod:`.serial` (``--jobs 1``: this process, no pool), :mod:`.pool` (``fork`` and ``loky``
process pools), :mod:`.threads` (joblib's threading backend), :mod:`.dask` (Dask futures, driven directly).
"""

from __future__ import annotations

import importlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from kvfast.sweep.grid import GridRun
from kvfast.sweep.plan import Planner
from kvfast.sweep.rows import Limits

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
    limits: Limits = None
    chunk_s: float = 0.5
    chunk_size: int | None = None
    stall_s: float = 300.0
    client: Any = None

    def planner(self, runs: Iterator[GridRun], total: int, workers: int | None = None) -> Planner:
        """A new :class:`Planner` over ``runs`` (``total`` of them) for ``workers`` (default ``jobs``)."""
        return Planner(runs, total, workers or self.jobs, self.chunk_s, self.chunk_size, self.recent)


_MODULES = {"serial": "serial", "fork": "pool", "loky": "pool", "threading": "threads", "dask": "dask"}


def execute(job: Job, runs: Iterator[GridRun], total: int) -> Outcome:
    """Run ``runs`` with ``job.backend``'s module (see the module docstring for the contract); the module is
    imported on first use (Dask only when asked for)."""
    return importlib.import_module(f"{__name__}.{_MODULES[job.backend]}").execute(job, runs, total)
