"""What guards a run of the user's code and a worker process: time limits, the parent's death, Ctrl-C.

(The sweep's runs use it.)

- :func:`worker_start` (a pool worker's initializer, and the first thing every
  task calls): on Linux the kernel kills the worker when the process that
  started it dies (``PR_SET_PDEATHSIG``), checked against the parent's pid so
  that a parent killed before the call is caught too; elsewhere a thread polls
  the parent once a second. Workers ignore SIGINT: Ctrl-C is the sweep
  process's to handle (it stops the workers), so no worker prints a traceback.
- :func:`deadline`: a run's time limit. At the limit the run is interrupted
  with :class:`RunTimeout`: in the main thread by ``SIGALRM`` from an interval
  timer (``signal.setitimer``), which also interrupts ``sleep`` and blocking
  calls; in another thread asynchronously (a ``threading.Timer``), which only
  interrupts Python code. If the run has not returned ``grace`` seconds later (a
  Numba kernel or C call that never checks for signals), a worker process ends:
  a pool worker (its runs in its main thread) is killed by the sweep process
  (:class:`kvfast.sweep.procs.Monitor`), which nothing the run does in its own
  process can switch off (C code holding the GIL, the run's own ``faulthandler``
  watchdog, which replaced the one kvfast armed here before issue 42: a process has
  one); a run in another thread (Dask) by a second timer that first writes the run's
  id into the marker folder (the sweep finds it and stores a ``timeout`` row). While
  a pool worker's run has a time limit, the name of the worker's thread that watches
  its parent (``/proc/self/task/TID/comm``, Linux) is the first 15 digits of the
  run's id (else :data:`WORKER_NAME`): the sweep reads it to time the run and to name
  the run of a worker it kills. Not the process's name (its main thread's), which a
  run may set itself (``setproctitle``). The sweep process itself (one job, or the
  threading backend) is never ended: there a run stuck in C code runs on until it
  returns.
- :data:`INTERRUPTED` (:mod:`kvfast.runtime.interrupt`'s): set by the sweep process's
  SIGINT handler :func:`on_sigint`, so that a ``KeyboardInterrupt`` raised by a
  run's own code (an ``error`` row) is told apart from the user's Ctrl-C (which
  stops the sweep).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvfast.runtime.interrupt import INTERRUPTED, on_sigint

__all__ = ["INTERRUPTED", "RunTimeout", "deadline", "grace", "name_worker", "on_sigint", "prctl", "worker_start"]

_STARTED: list[int] = []
WORKER_NAME = b"kvfast-worker"  # a pool worker's watch thread's name between runs (in one: the run's id, 15 digits)
_NAME: list[int] = []  # [fd] of the comm file of a pool worker's watch thread (Linux), written as each run starts/ends


class RunTimeout(BaseException):  # noqa: N818 - a BaseException, so that a run's `except Exception` cannot hide it
    """Raised inside a run that passed its time limit."""


def prctl(option: int, value) -> int:
    """Linux ``prctl(option, value)`` through libc; -1 where there is none."""
    try:
        return _libc().prctl(option, value, 0, 0, 0)
    except (OSError, TypeError, AttributeError):  # no C library by the program's name (Windows), no prctl (not Linux)
        return -1


@functools.cache
def _libc() -> ctypes.CDLL:
    """This process's C library (dlopen of the program itself), opened on first use: importing a sweep never
    fails where there is none."""
    return ctypes.CDLL(None, use_errno=True)


def grace(seconds: float) -> float:
    """How long a run past its time limit of ``seconds`` may take to return before its worker ends (the sweep
    kills a pool worker whose run has not returned ``seconds + grace(seconds)`` after it started)."""
    return min(30.0, 1.0 + 0.25 * seconds)


def worker_start(parent: int | None = None) -> None:
    """Set up a pool worker (idempotent): die with the parent, ignore SIGINT."""
    if _STARTED:
        return
    _STARTED.append(os.getpid())
    INTERRUPTED.clear()
    faulthandler.disable()  # a crashing run is one line in the sweep's report, not a dump per worker
    parent = parent or os.getppid()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(0)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    thread = threading.Thread(target=watch, name="kvfast-watch-parent", daemon=True)
    thread.start()
    with contextlib.suppress(OSError):  # (not Linux: no such file; the sweep's watch is Linux's too)
        _NAME[:] = [os.open(f"/proc/self/task/{thread.native_id}/comm", os.O_WRONLY)]
        name_worker(WORKER_NAME)


def name_worker(name: bytes) -> None:
    """Name this pool worker's watch thread (see the module doc): the sweep reads it, a run does not set it."""
    if _NAME:
        with contextlib.suppress(OSError):
            os.write(_NAME[0], name)


_ARMED: dict[int, bool] = {}  # thread ident -> its run's deadline is armed (may still interrupt it)
_LOCK = threading.Lock()  # once a deadline is disarmed, no timer interrupts its thread


def _on_alarm(signum, frame) -> None:
    if _ARMED.get(threading.get_ident()):
        raise RunTimeout


def _interrupt(ident: int) -> None:
    """Raise :class:`RunTimeout` in thread ``ident`` (not the main one) if its deadline is still armed."""
    with _LOCK:
        if _ARMED.get(ident):
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(RunTimeout))


def _end_worker(marker_dir: Path | None, run_id: str) -> None:
    """A worker thread's run is past its grace: leave the run's marker and end the worker."""
    if marker_dir is not None:
        with contextlib.suppress(OSError):
            marker_dir.mkdir(exist_ok=True)
            (marker_dir / run_id).write_text(str(os.getpid()))
    os._exit(3)


def deadline(seconds: float | None, run_id: str, marker_dir: Path | None) -> contextlib.AbstractContextManager:
    """Interrupt the block with :class:`RunTimeout` after ``seconds`` (``None``: no limit); see the module doc."""
    return _deadline(seconds, run_id, marker_dir) if seconds else _NO_DEADLINE


_NO_DEADLINE = contextlib.nullcontext()  # a run without a time limit (every run of most sweeps): nothing to set up


@contextmanager
def _deadline(seconds: float, run_id: str, marker_dir: Path | None) -> Iterator[None]:
    ident, main = threading.get_ident(), threading.current_thread() is threading.main_thread()
    hard = bool(_STARTED) and _STARTED[0] == os.getpid()  # only a pool worker may be ended
    _ARMED[ident] = True
    timers = [] if main else [threading.Timer(seconds, _interrupt, (ident,))]
    if main:
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        if hard:
            name_worker(run_id[:15].encode())  # the sweep times the run by it
    elif hard:
        timers.append(threading.Timer(seconds + grace(seconds), _end_worker, (marker_dir, run_id)))
    for timer in timers:
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        with _LOCK:
            _ARMED.pop(ident, None)
        for timer in timers:
            timer.cancel()
        if main:
            signal.setitimer(signal.ITIMER_REAL, 0)
            if hard:
                name_worker(WORKER_NAME)
            signal.signal(signal.SIGALRM, previous)
