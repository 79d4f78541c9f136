"""How a sweep runs: one validated, immutable options object, built once.

:meth:`SweepOptions.build` takes the options as ``kvfast run`` and
:func:`kvfast.sweep.run_sweep` name them and resolves the defaults; the object checks every
option as it is made (a ``ValueError`` of one line, ``--option: VALUE is not allowed; allowed:
WHAT``, before anything runs or is touched) and resolves ``jobs`` once, into the one value
every part of the sweep reads:

- ``jobs=None`` (through :meth:`~SweepOptions.build`) is every core; more than the machine's
  cores is capped to it with a warning (not with a Dask ``scheduler``: a cluster has its own);
- ``backend="fork"`` is ``loky`` where fork is unavailable or unsafe (not Linux).

A :class:`SweepOptions` made directly is checked and capped too, but ``jobs`` must be an integer.
"""

from __future__ import annotations

import multiprocessing
import sys
from dataclasses import dataclass

from kvfast.runtime.deadline import check_timeout
from kvfast.validation import require_choice, require_int

BACKENDS = ("fork", "loky", "threading", "dask")


@dataclass(frozen=True)
class SweepOptions:
    """The options of one sweep (see the module docstring and ``docs/sweep.md``).

    ``jobs``: workers; ``backend``: one of :data:`BACKENDS`; ``scheduler``: a Dask
    scheduler address (``backend="dask"`` only); ``retry_errors``: also re-run
    runs stored as ``error``, ``crashed`` or ``timeout``; ``fresh``: delete stored
    results first; ``quiet``: no progress (bar or lines); ``chunk_s``: seconds of work per
    chunk; ``chunk_size``: a fixed chunk size instead; ``stall_s``: Dask gives up
    when nothing finishes for that long, fork and loky kill a worker stopped that
    long; ``run_timeout``: seconds a run may take;
    ``max_memory``: bytes a run may need by kvfast's estimate (``None``: this machine's).
    """

    jobs: int = 1
    backend: str = "fork"
    scheduler: str | None = None
    retry_errors: bool = False
    fresh: bool = False
    quiet: bool = False
    chunk_s: float = 0.5
    chunk_size: int | None = None
    stall_s: float = 300.0
    run_timeout: float | None = None
    max_memory: int | None = None

    def __post_init__(self) -> None:
        require_choice(self.backend, "--backend", BACKENDS)
        check_jobs(self.jobs)
        cores = _cores()
        if self.jobs > cores and not (self.backend == "dask" and self.scheduler):
            print(f"warning: --jobs {self.jobs} is more than the {cores} cores here; using {cores}", file=sys.stderr)
            object.__setattr__(self, "jobs", cores)  # (frozen: set once, here)
        check_timeout(self.run_timeout, "--run-timeout")  # above its bound the runs' interval timer overflows
        if self.scheduler and self.backend != "dask":
            raise ValueError(f"--scheduler: {self.scheduler!r} needs --backend dask (backend is {self.backend!r})")
        if self.chunk_size is not None:
            require_int(self.chunk_size, "chunk_size", 1)

    @classmethod
    def build(cls, *, jobs: int | None = None, backend: str = "fork", **options) -> SweepOptions:
        """Resolve the defaults (see the module docstring) and make the options; ``ValueError`` if one is bad."""
        fork = sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()
        if backend == "fork" and not fork:  # Windows has no fork, and macOS system libraries are not fork-safe
            backend = "loky"
        return cls(jobs=_cores() if jobs is None else jobs, backend=backend, **options)

    @property
    def redo(self) -> tuple[str, ...]:
        """The stored statuses this sweep runs again."""
        return ("error", "crashed", "timeout") if self.retry_errors else ()


def check_jobs(jobs) -> None:
    """The one check of ``--jobs``: an integer >= 1 (``ValueError`` naming it)."""
    require_int(jobs, "--jobs", 1)


def _cores() -> int:
    """This machine's cores as joblib counts them (the CPU affinity and a container's CPU quota included)."""
    import joblib

    return joblib.cpu_count()
