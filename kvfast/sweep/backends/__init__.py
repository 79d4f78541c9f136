"""Backends: how chunks of runs reach workers. One module per backend, one contract.

Every backend module has

- ``preheat(job) -> None``: an optional head start, run in a thread while the
  warm-up run executes in the sweep's process (start a pool, import the study in
  the workers); it never raises;
- ``supervised(job)`` (optional): a context manager held from before the warm-up run
  until ``execute`` returns (the pool backends' watch over their worker processes);
- ``warms_up(job) -> bool`` and ``warm_up(job, runs)`` (optional, the ``fork`` backend): warm-up runs of
  other compile keys (:attr:`kvfast.sweep.study.Study.compile_key`) started in helper processes before
  the sweep's process runs its own; the handle's ``rows()`` waits for their rows, ``close()`` ends them;
- ``execute(job, runs, total) -> Outcome``: run ``total`` runs from the iterator
  ``runs`` (cut into chunks by ``job.plan``) and hand every finished chunk's rows
  to ``job.write(runs, rows)``, from the calling thread. Each run's row is made by
  :mod:`kvfast.sweep.rows`. A run that raises is an ``error`` row; a chunk whose
  worker dies is re-run one run at a time, each alone in a worker, and a run that
  kills its worker again is a ``crashed`` row (``timeout`` if the worker killed
  itself at the run's time limit). ``KeyboardInterrupt`` (the user's Ctrl-C) stops
  the workers at once and propagates. Runs that end with no row (Dask: a stall, a
  lost scheduler) are returned in the :class:`Outcome`; pool backends lose none.

The modules: :mod:`.inline` (``--jobs 1``: this process, no pool), :mod:`.pool`
(``fork`` and ``loky`` process pools, through joblib), :mod:`.threads` (joblib's
threading backend), :mod:`.dask` (Dask futures, driven directly).
"""

from __future__ import annotations

import contextlib
import importlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple

from kvfast.sweep.grid import Run
from kvfast.sweep.plan import Planner
from kvfast.sweep.rows import Limits

if TYPE_CHECKING:
    from kvfast.sweep.study import Study


class Outcome(NamedTuple):
    """What a backend could not store: the ids of runs lost, and why in a few words ("" if none)."""

    lost: list[str]
    reason: str


NOTHING_LOST = Outcome([], "")


@dataclass
class Job:
    """What a backend needs to execute a sweep's runs.

    ``backend``: the backend's name (``fork``, ``loky``, ``threading``, ``dask``,
    or ``inline``); ``workers``: how many (a Dask backend sets it from its
    cluster); ``client``: the Dask client, if any; ``recent``: the wall times of
    the last ``ok`` runs (the writer fills it; planners read it); ``worker_versions``: what each Dask worker
    runs (kvfast, the study's version; ``refused`` when it differs from this process), for the manifest.
    """

    study: Study
    backend: str
    workers: int
    write: Callable[[Sequence[Run], list[dict]], None]
    recent: deque
    limits: Limits = None
    chunk_s: float = 0.5
    chunk_size: int | None = None
    stall_s: float = 300.0
    client: Any = None
    planners: list[Planner] = field(default_factory=list)
    worker_versions: dict[str, dict] = field(default_factory=dict)  # Dask: worker address -> its versions

    def plan(self, runs: Iterator[Run], total: int) -> Planner:
        """A new :class:`Planner` over ``runs`` (``total`` of them) for this job's workers."""
        self.planners.append(Planner(runs, total, self.workers, self.chunk_s, self.chunk_size, self.recent))
        return self.planners[-1]

    @property
    def largest_chunk(self) -> int:
        """The largest chunk handed out so far (the steady-state size)."""
        return max((p.largest for p in self.planners), default=0)


_MODULES = {"inline": "inline", "fork": "pool", "loky": "pool", "threading": "threads", "dask": "dask"}


def backend_module(name: str) -> ModuleType:
    """The module that implements backend ``name`` (imported on first use: Dask only when asked for)."""
    return importlib.import_module(f"{__name__}.{_MODULES[name]}")


def supervised(job: Job) -> contextlib.AbstractContextManager:
    """``job.backend``'s watch over its workers, from the warm-up until it is done (a no-op where it has none)."""
    module = backend_module(job.backend)
    return module.supervised(job) if hasattr(module, "supervised") else contextlib.nullcontext()


def execute(job: Job, runs: Iterator[Run], total: int) -> Outcome:
    """Run ``runs`` with ``job.backend``'s module (see the module docstring for the contract)."""
    return backend_module(job.backend).execute(job, runs, total)
