"""``--backend fork`` and ``loky``: chunks fanned out to worker processes through joblib.

Both are joblib parallel backends, registered under the names ``kvfast-fork``
and ``kvfast-loky`` (:class:`ProcessPoolBackend`), and driven by one
``joblib.Parallel`` call per pool (``batch_size=1``: a task is one chunk;
``pre_dispatch="2*n_jobs"``: about two chunks per worker in flight; results
unordered, as they finish):

- ``fork``: a ``concurrent.futures`` pool of processes forked from the sweep's
  after its warm-up run, so workers start in milliseconds with its modules and
  compiled kernels, and tasks carry only their chunk (Linux; when the warm-up has
  imported a library of :data:`FORK_UNSAFE`, the sweep uses ``loky`` instead);
- ``loky``: loky's reusable pool of fresh interpreters (started, and the study
  imported in every worker, by :func:`preheat` while the warm-up runs).

With a study's ``compile_key``, ``fork`` also runs the warm-up runs of other keys
(:func:`warm_up`): in helper processes forked before the sweep's process compiles
anything, one run each, at the same time as the sweep's own warm-up; they are
killed once their rows are in, before the pool for the rest is forked.

Workers are set up by :func:`kvfast.sweep.procs.worker_setup` (they die with the
sweep, ignore SIGINT, lead their own process group and end the processes each run
leaves); one whose run is past its time limit and its grace, or stopped (``SIGSTOP``), is
killed by the sweep's :class:`kvfast.sweep.procs.Monitor` (:func:`supervised`). A dead worker breaks its
pool: joblib aborts the call (the backend kills the other workers), the runs not yet
handed out go on in a new pool, and those of the chunks in flight are re-run one at
a time, each alone in a new one-worker pool (:meth:`ProcessPoolBackend.run_alone`:
submitted directly, as joblib runs a one-job call in the calling process, where a
crashing run would take the sweep with it), ``timeout`` when past its time limit,
``crashed`` when it kills that worker sooner. On Ctrl-C joblib aborts the call and
the backend kills the workers at once.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool, ProcessPoolExecutor
from typing import TYPE_CHECKING

from joblib import Parallel, delayed, register_parallel_backend
from joblib._parallel_backends import ParallelBackendBase, SequentialBackend

from kvfast.runtime.worker import grace
from kvfast.sweep.backends import NOTHING_LOST, Job, Outcome
from kvfast.sweep.grid import Run
from kvfast.sweep.procs import OVERDUE, Monitor, kill_worker, worker_setup
from kvfast.sweep.rows import Limits, lost_worker_row, run_chunk, run_chunk_in_worker, timeout_row

if TYPE_CHECKING:
    from kvfast.sweep.study import Study

# Libraries whose native thread pools do not survive a fork: once the warm-up run has imported one
# (a study that builds torch models), a forked worker blocks forever on a lock held by a thread that
# was not copied. Such sweeps use loky (fresh interpreters) instead.
FORK_UNSAFE = ("torch", "tensorflow", "jax")

_FORKED: list = []  # (study, limits), as forked workers inherit them (nothing to pickle but the chunks)


def fork_unsafe_modules() -> list[str]:
    """The :data:`FORK_UNSAFE` libraries this process has imported."""
    return [name for name in FORK_UNSAFE if name in sys.modules]


def run_chunk_forked(chunk: tuple[int, list[Run]]) -> tuple[int, list[dict]]:
    """A forked worker's task: :func:`~kvfast.sweep.rows.run_chunk` with the study it inherited."""
    study, limits = _FORKED[-1]
    return run_chunk(study, chunk, limits)


def loky_pool(n_jobs: int):
    """loky's reusable pool of ``n_jobs`` workers (started by this process; each dies with it)."""
    from joblib.externals.loky import get_reusable_executor

    return get_reusable_executor(max_workers=n_jobs, initializer=worker_setup, initargs=(os.getpid(),))


def release_workers() -> None:
    """Kill loky's reusable workers, if this process started any: a command is done. Never joined: a worker
    stopped (SIGSTOP) after the sweep's last look would hold the interpreter's exit for ever (loky joins its
    workers at exit)."""
    from joblib.externals.loky import reusable_executor

    shutdown(reusable_executor._executor, kill=True)


def _fork_pool(n_jobs: int) -> ProcessPoolExecutor:
    context = multiprocessing.get_context("fork")
    return ProcessPoolExecutor(n_jobs, mp_context=context, initializer=worker_setup, initargs=(os.getpid(),))


def shutdown(pool, kill: bool) -> None:
    """Shut a pool down; ``kill``: its workers first (a run in progress, or hung, is not waited for)."""
    if pool is None:
        return
    if kill:
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            with contextlib.suppress(Exception):
                kill_worker(proc.pid)
    if hasattr(pool, "_flags"):  # loky's executor (its exit hook wakes a manager thread under the pool's lock)
        with contextlib.suppress(Exception):
            pool.shutdown(wait=not kill, kill_workers=kill)
        return
    with _manager_thread_ended(pool), contextlib.suppress(Exception):
        pool.shutdown(wait=not kill, cancel_futures=True)


@contextlib.contextmanager
def _manager_thread_ended(pool: ProcessPoolExecutor) -> Iterator[None]:
    """Wrapped around ``pool.shutdown``: after it, wait (at most :data:`MANAGER_JOIN_SECONDS`) for the pool's
    manager thread to end; one still alive is taken off the list of Python's exit hook for process pools.

    Written for CPython 3.11 (3.11.7; no 3.11 release has the fix), 3.12 before 3.12.8 and 3.13.0. Their exit hook
    (``concurrent.futures.process._python_exit``) writes to the wake-up pipe of every manager thread listed in
    ``_threads_wakeups`` without a lock, while the thread may be closing that pipe (``join_executor_internals``):
    ``OSError: [Errno 9] Bad file descriptor`` printed at exit after a sweep that succeeded. 3.12.8 and 3.13.1 give
    the pipe a lock of its own (gh-125451); there this is only a wait. CPython private names, read with defaults
    (gone: nothing done, and tests/sweep/test_sweep_pool_exit.py fails): the pool's ``_executor_manager_thread``, read
    before ``shutdown`` since ``shutdown(wait=False)`` (every ``kill``) sets it to None, and ``_threads_wakeups``.
    """
    manager = getattr(pool, "_executor_manager_thread", None)
    yield
    if manager is None or manager is threading.current_thread():  # a future's done-callback runs in that thread
        return
    manager.join(timeout=MANAGER_JOIN_SECONDS)
    if manager.is_alive():
        from concurrent.futures import process

        getattr(process, "_threads_wakeups", {}).pop(manager, None)


MANAGER_JOIN_SECONDS = 5.0
"""How long :func:`shutdown` waits for a pool's manager thread to end (with ``kill`` its workers are dead: it ends
at once; without, ``shutdown(wait=True)`` joined it already)."""


class ProcessPoolBackend(ParallelBackendBase):
    """A joblib backend over a process pool that reports a dead worker as ``BrokenProcessPool``.

    ``kind``: ``"fork"`` (a new forked pool per ``Parallel`` call, shut down at its
    end) or ``"loky"`` (loky's reusable pool, kept for the next call). Aborting a
    call (a task failed, Ctrl-C) kills the workers. :meth:`run_alone` runs one task
    in a new one-worker pool.
    """

    supports_retrieve_callback = True
    kind = "fork"

    def __init__(self, nesting_level: int | None = None, inner_max_num_threads: int | None = None, **kwargs) -> None:
        super().__init__(nesting_level=nesting_level, inner_max_num_threads=inner_max_num_threads, **kwargs)
        self.pool = None
        self.n_jobs = 1

    def new_pool(self, n_jobs: int):
        """A pool of ``n_jobs`` workers of this backend's kind."""
        return _fork_pool(n_jobs) if self.kind == "fork" else loky_pool(n_jobs)

    def effective_n_jobs(self, n_jobs: int | None) -> int:
        return max(1, n_jobs or 1)

    def configure(self, n_jobs: int = 1, parallel=None, **backend_kwargs) -> int:
        self.parallel = parallel
        self.n_jobs = self.effective_n_jobs(n_jobs)
        self.pool = self.new_pool(self.n_jobs)
        return self.n_jobs

    def submit(self, func, callback=None):
        future = self.pool.submit(func)
        if callback is not None:
            future.add_done_callback(callback)
        return future

    def apply_async(self, func, callback=None):
        """joblib before 1.5 calls this name (untested here: joblib 1.6 is installed)."""
        return self.submit(func, callback)

    def retrieve_result_callback(self, future):
        return future.result()  # BrokenProcessPool when a worker died

    def terminate(self) -> None:
        if self.kind == "fork":  # every result is in: kill, not join (a stopped idle worker holds the queue's lock)
            shutdown(self.pool, kill=True)
        self.pool = None

    def abort_everything(self, ensure_ready: bool = True) -> None:
        shutdown(self.pool, kill=True)
        self.pool = self.new_pool(self.n_jobs) if ensure_ready else None

    def get_nested_backend(self):
        return SequentialBackend(nesting_level=(self.nesting_level or 0) + 1), None

    def run_alone(self, func, *args, seconds: float | None = None):
        """``func(*args)`` in a new one-worker pool. ``TimeoutError`` (the worker killed) when it has not
        returned ``seconds`` (the run's time limit) plus the worker's grace and one second after the worker
        was ready, or when the worker died after ``seconds``; ``BrokenProcessPool`` when it died sooner."""
        pool = self.new_pool(1)
        try:
            pool.submit(os.getpid).result()  # a worker is up: the time counts from here
            started = time.monotonic()
            try:
                result = pool.submit(func, *args).result(seconds and seconds + grace(seconds) + 1.0)
            except BrokenProcessPool:
                if seconds and time.monotonic() - started >= seconds:
                    raise TimeoutError from None
                raise
        except BaseException:
            shutdown(pool, kill=True)
            raise
        if self.kind == "fork":
            shutdown(pool, kill=True)  # the result is in (see terminate)
        return result


class ForkBackend(ProcessPoolBackend):
    """``kvfast-fork``: processes forked from the sweep's after its warm-up."""

    kind = "fork"


class LokyBackend(ProcessPoolBackend):
    """``kvfast-loky``: loky's reusable pool of fresh interpreters."""

    kind = "loky"


register_parallel_backend("kvfast-fork", ForkBackend)
register_parallel_backend("kvfast-loky", LokyBackend)


def preheat(job: Job) -> None:
    """loky: start the pool (the one the sweep then reuses) and have every worker import the study; returns at
    once (the workers start meanwhile). Call it from the thread that runs the sweep: a worker dies with the
    thread that started it (``PR_SET_PDEATHSIG``), and a helper thread that ends would take the pool along."""
    if job.backend != "loky":
        return
    try:
        pool = loky_pool(job.workers)
        for _ in range(job.workers):
            pool.submit(run_chunk_in_worker, job.study, (0, []))  # no run: it imports the study
    except Exception:  # noqa: BLE001 - only a head start; the sweep itself reports any failure
        pass


class WarmUps:
    """Warm-up runs executing in forked helper processes while the sweep's process runs its own
    (:func:`warm_up`): :meth:`rows` waits for them; :meth:`close` kills the helpers (idempotent)."""

    def __init__(self, job: Job, runs: list[Run]) -> None:
        self.job, self.runs = job, runs
        _FORKED.append((job.study, job.limits))
        try:
            self.pool = _fork_pool(min(job.workers - 1, len(runs)))
            # the first submit forks every helper, now, from this thread: before this process compiles anything
            # (a fork while Numba compiles would copy its held lock); one run a task, in order
            self.futures = [self.pool.submit(warm_up_forked, (i, [run])) for i, run in enumerate(runs)]
        finally:
            _FORKED.pop()

    def rows(self) -> list[dict]:
        """Every run's row, in order, once all have finished. A run whose helper died (it, or another run of
        the same helper) is run again alone in a new one-worker pool, as the runs of a chunk whose worker died
        (``crashed`` if it kills that one too, ``timeout`` past its time limit)."""
        rows: list[dict | None] = []
        for future in self.futures:
            try:
                rows.append(future.result()[1][0])
            except BrokenProcessPool:
                rows.append(None)
        self.close()
        if any(row is None for row in rows):
            backend = ForkBackend()
            _FORKED.append((self.job.study, self.job.limits))
            try:
                rows = [
                    row if row is not None else _alone(backend, self.job.study, run, self.job.limits)
                    for run, row in zip(self.runs, rows, strict=True)
                ]
            finally:
                _FORKED.pop()
        return rows

    def close(self) -> None:
        shutdown(self.pool, kill=True)


HELPER_NICE = 5
"""How much lower a warm-up helper's priority is than the sweep process's (``os.nice``): on a machine whose
other work leaves no core free, the sweep's own warm-up (which the rest waits for) compiles first and the
helpers fill what is left (as without them); with a free core, each runs on its own. Moderate, not 19: a helper
may hold a kernel's compile lock the sweep's process waits for."""


def warm_up_forked(chunk: tuple[int, list[Run]]) -> tuple[int, list[dict]]:
    """A warm-up helper's task: :func:`run_chunk_forked` at :data:`HELPER_NICE` (set once per helper)."""
    if not _NICED:
        _NICED.append(True)
        with contextlib.suppress(OSError):
            os.nice(HELPER_NICE)
    return run_chunk_forked(chunk)


_NICED: list = []  # [True] in a helper whose priority is lowered


def warm_up(job: Job, runs: list[Run]) -> WarmUps | None:
    """Start ``runs`` (warm-up runs of other compile keys than the sweep process's own) in ``job.workers - 1``
    forked helper processes, at most one per run, before the sweep's process runs its warm-up: their compiles
    and its own run at the same time (kernels they share are compiled once: a lock per kernel, and each loads
    what another compiled). ``None`` (nothing started) for a backend other than ``fork``, one worker, or a
    process that has imported a :data:`FORK_UNSAFE` library. Call it from the thread that runs the sweep."""
    return WarmUps(job, runs) if runs and warms_up(job) else None


def warms_up(job: Job) -> bool:
    """Whether :func:`warm_up` starts helpers for ``job``: the ``fork`` backend, several workers, and no
    :data:`FORK_UNSAFE` library imported."""
    return job.backend == "fork" and job.workers > 1 and not fork_unsafe_modules()


def supervised(job: Job) -> Monitor:
    """The sweep's watch over stopped workers (:class:`~kvfast.sweep.procs.Monitor`), a context manager the
    engine holds from before the warm-up (while the pool starts) until the backend is done."""
    seconds = job.limits[0] if job.limits else None
    return Monitor(min(job.stall_s, seconds) if seconds else job.stall_s, seconds)


def execute(job: Job, runs: Iterator[Run], total: int) -> Outcome:
    """Fan chunks out to ``job.workers`` processes (see the module docstring)."""
    kind = "loky" if job.backend == "fork" and fork_unsafe_modules() else job.backend
    suspects: list[Run] = []
    remaining: Iterator[Run] | None = runs
    if kind == "fork":
        _FORKED.append((job.study, job.limits))
    try:
        while remaining is not None:
            planner = job.plan(remaining, total)
            try:
                for index, rows in _fan_out(kind, planner, job):
                    job.write(planner.returned(index), rows)
                remaining = None
            except BrokenProcessPool:
                suspects += [r for chunk in list(planner.handed.values()) for r in chunk]
                remaining, total = planner.rest()
        backend = ForkBackend() if kind == "fork" else LokyBackend()
        for run in suspects:
            job.write([run], [_alone(backend, job.study, run, job.limits)])
    finally:
        if kind == "fork":
            _FORKED.pop()
    return NOTHING_LOST


def _fan_out(kind: str, planner, job: Job) -> Iterator[tuple[int, list[dict]]]:
    """``(chunk index, rows)`` of every chunk ``planner`` hands out, as they finish, from one ``Parallel`` call."""

    def tasks() -> Iterator:
        while (chunk := planner.take()) is not None:
            if kind == "fork":
                yield delayed(run_chunk_forked)(chunk)
            else:
                yield delayed(run_chunk_in_worker)(job.study, chunk, job.limits)

    parallel = Parallel(
        n_jobs=job.workers,
        backend=f"kvfast-{kind}",
        batch_size=1,
        pre_dispatch="2*n_jobs",
        return_as="generator_unordered",
    )
    results = parallel(tasks())
    try:
        with warnings.catch_warnings():  # joblib's note about tasks cancelled by an abort
            warnings.filterwarnings("ignore", message=".*tasks have been successfully executed")
            yield from results
    finally:
        results.close()  # an exception here (a failed write): joblib aborts the call and kills the workers


def _alone(backend: ProcessPoolBackend, study: Study, run: Run, limits: Limits) -> dict:
    """The row of a run whose chunk's worker died, re-run alone in a new one-worker pool (``timeout`` at once
    when its worker was killed stopped past the run's limit: :data:`~kvfast.sweep.procs.OVERDUE`)."""
    if run.run_id[:15] in OVERDUE:
        OVERDUE.discard(run.run_id[:15])
        return timeout_row(study, run, limits)
    forked = backend.kind == "fork"
    task = (run_chunk_forked, (0, [run])) if forked else (run_chunk_in_worker, study, (0, [run]), limits)
    try:
        return backend.run_alone(*task, seconds=limits[0] if limits else None)[1][0]
    except TimeoutError:
        return timeout_row(study, run, limits)
    except BrokenProcessPool:
        return lost_worker_row(study, run, limits)
