"""``--backend fork`` and ``loky``: chunks fanned out to worker processes, through the executors' public API.

- ``fork``: a ``concurrent.futures.ProcessPoolExecutor`` of processes forked from the sweep's after its
  warm-up run, so workers start in milliseconds with its modules and compiled kernels, and tasks carry only
  their chunk (Linux; when the warm-up has imported a library of :data:`FORK_UNSAFE`, the sweep uses ``loky``
  instead);
- ``loky``: loky's reusable executor of fresh interpreters (``get_reusable_executor``).

About two chunks per worker are in flight (a task is one chunk; results as they finish). Workers are set up
by :func:`kvfast.sweep.procs.worker_setup` (they die with the sweep, ignore SIGINT, lead their own process
group and end the processes each run leaves); one whose run is past its time limit and its grace, or
stopped (``SIGSTOP``), is killed by the sweep's :class:`kvfast.sweep.procs.Monitor`, which watches while
:func:`execute` runs. A dead worker breaks its pool (``BrokenProcessPool``; loky's ``TerminatedWorkerError``
is one): the pool is killed, the runs not yet handed out go on in a new pool, and those of the chunks in
flight are re-run one at a time, each alone in a new one-worker pool (:func:`_alone`), ``timeout`` when past
its time limit, ``crashed`` when it kills that worker sooner. On Ctrl-C, or when writing rows fails, the
pool is killed at once and the exception propagates.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, wait
from concurrent.futures.process import BrokenProcessPool, ProcessPoolExecutor

from kvfast.runtime.worker import grace
from kvfast.sweep.backends import Job, Outcome
from kvfast.sweep.grid import GridRun
from kvfast.sweep.plan import Planner
from kvfast.sweep.procs import OVERDUE, Monitor, kill_worker, worker_setup
from kvfast.sweep.rows import lost_worker_row, run_chunk, run_chunk_in_worker, timeout_row

# Libraries whose native thread pools do not survive a fork: once the warm-up run has imported one
# (a study that builds torch models), a forked worker blocks forever on a lock held by a thread that
# was not copied. Such sweeps use loky (fresh interpreters) instead.
FORK_UNSAFE = ("torch", "tensorflow", "jax")

_FORKED: list = []  # (study, limits), as forked workers inherit them (nothing to pickle but the chunks)


def run_chunk_forked(chunk: tuple[int, list[GridRun]]) -> tuple[int, list[dict]]:
    """A forked worker's task: :func:`~kvfast.sweep.rows.run_chunk` with the study it inherited."""
    study, limits = _FORKED[-1]
    return run_chunk(study, chunk, limits)


def new_pool(kind: str, jobs: int):
    """A pool of ``jobs`` workers: forked (``kind`` ``"fork"``), or loky's reusable one (started by this process;
    each worker dies with it)."""
    if kind == "fork":
        context = multiprocessing.get_context("fork")
        return ProcessPoolExecutor(jobs, mp_context=context, initializer=worker_setup, initargs=(os.getpid(),))
    from joblib.externals.loky import get_reusable_executor

    return get_reusable_executor(max_workers=jobs, initializer=worker_setup, initargs=(os.getpid(),))


def release_workers() -> None:
    """Kill loky's reusable workers, if this process started any: a command is done. Never joined: a worker
    stopped (SIGSTOP) after the sweep's last look would hold the interpreter's exit for ever (loky joins its
    workers at exit)."""
    from joblib.externals.loky import reusable_executor

    shutdown(reusable_executor._executor, kill=True)


def shutdown(pool, kill: bool) -> None:
    """Shut a pool down; ``kill``: its workers first (a run in progress, or hung, is not waited for).

    Killing reads the executor's ``_processes`` (pid -> process), the one private name both executors share:
    neither has a public way to kill its workers at once (CPython's ``kill_workers`` arrived in 3.14; loky's
    ``shutdown(kill_workers=True)`` kills from its manager thread, later). Gone: nothing is killed, and
    tests/sweep/test_sweep_pool_exit.py fails."""
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


def execute(job: Job, runs: Iterator[GridRun], total: int) -> Outcome:
    """Fan chunks out to ``job.jobs`` processes, watched by a :class:`~kvfast.sweep.procs.Monitor` (see the module
    docstring)."""
    kind = "loky" if job.backend == "fork" and any(name in sys.modules for name in FORK_UNSAFE) else job.backend
    seconds = job.limits.seconds
    suspects: list[GridRun] = []
    largest = 0
    remaining: Iterator[GridRun] | None = runs
    _FORKED.append((job.study, job.limits))  # what the pools forked within inherit (run_chunk_forked)
    try:
        with Monitor(min(job.stall_s, seconds) if seconds else job.stall_s, seconds):
            while remaining is not None:
                planner = job.planner(remaining, total)
                try:
                    _fan_out(kind, planner, job)
                    remaining = None
                except BrokenProcessPool:
                    suspects += [r for chunk in planner.handed.values() for r in chunk]
                    remaining, total = planner.rest()
                largest = max(largest, planner.largest)
            for run in suspects:
                job.write([run], [_alone(kind, job, run)])
    finally:
        _FORKED.pop()
    return Outcome(workers=job.jobs, chunk_size=largest)


def _task(kind: str, job: Job, chunk: tuple[int, list[GridRun]]) -> tuple:
    """The callable and arguments that run ``chunk`` in a worker of ``kind``."""
    return (run_chunk_forked, chunk) if kind == "fork" else (run_chunk_in_worker, job.study, chunk, job.limits)


def _fan_out(kind: str, planner: Planner, job: Job) -> None:
    """Every chunk ``planner`` hands out through one pool, about two per worker in flight; each chunk's rows
    written as it finishes. ``BrokenProcessPool`` when a worker died (the chunks in flight stay in
    ``planner.handed``). The pool is killed unless every chunk came back from loky's (reused by the next call)."""
    pool = new_pool(kind, job.jobs)
    in_flight: dict = {}
    finished = False
    try:
        while True:
            while len(in_flight) < 2 * job.jobs and (chunk := planner.take()) is not None:
                in_flight[pool.submit(*_task(kind, job, chunk))] = chunk[0]
            if not in_flight:
                break
            done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            broken = None
            for future in done:
                index = in_flight.pop(future)
                try:
                    rows = future.result()[1]
                except BrokenProcessPool as exc:
                    broken = exc
                    continue
                job.write(planner.returned(index), rows)
            if broken is not None:
                raise broken
        finished = True
    finally:
        if kind == "fork" or not finished:  # fork: every result is in: kill, not join (a stopped idle worker
            shutdown(pool, kill=True)  # holds the queue's lock); an abort: the runs in progress are not waited for


def _alone(kind: str, job: Job, run: GridRun) -> dict:
    """The row of a run whose chunk's worker died, re-run alone in a new one-worker pool: ``timeout`` when it has
    not returned its time limit plus the worker's grace and one second after the worker was ready, or when the
    worker died after the limit (or was killed stopped past it: :data:`~kvfast.sweep.procs.OVERDUE`, at once);
    ``crashed`` when it died sooner (:func:`~kvfast.sweep.rows.lost_worker_row`)."""
    study, limits, seconds = job.study, job.limits, job.limits.seconds
    if run.run_id[:15] in OVERDUE:
        OVERDUE.discard(run.run_id[:15])
        return timeout_row(study, run, limits)
    pool, started = new_pool(kind, 1), None
    try:
        pool.submit(os.getpid).result()  # a worker is up: the time counts from here
        started = time.monotonic()
        return pool.submit(*_task(kind, job, (0, [run]))).result(seconds and seconds + grace(seconds) + 1.0)[1][0]
    except TimeoutError:
        return timeout_row(study, run, limits)
    except BrokenProcessPool:
        if seconds and started is not None and time.monotonic() - started >= seconds:
            return timeout_row(study, run, limits)
        return lost_worker_row(study, run, limits)
    finally:
        shutdown(pool, kill=True)
