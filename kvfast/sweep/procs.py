"""Pool workers' processes: their process trees, and the sweep process's watch over stopped ones.

Worker side (Linux; elsewhere these are no-ops):

- :func:`worker_setup` (a pool worker's initializer): :func:`kvfast.runtime.worker.worker_start`,
  then the worker leads its own process group (so a run's children, which inherit
  the group, are ended with it by one ``killpg``) and becomes a child subreaper
  (so a run's grandchildren whose parent exits, daemons included, are re-parented
  to the worker instead of init, and are found); a keeper process in its group
  kills the group when the worker dies, however it dies (``kill -9`` of the sweep too).
- :class:`RunTree`: after each run, every process the run left behind (children
  not there before the run, and all their descendants) is killed.

Sweep side: :class:`Monitor`, a thread of the sweep process while a pool backend works (its
warm-up, while the pool starts, included). Twice a second it reads the state of every child process
of the sweep (psutil) and the name of a worker's watch thread, which a run with a time limit bears
(:mod:`kvfast.runtime.worker`). A child stopped (``SIGSTOP``: state ``T``), whatever it was doing (a
run, nothing, starting up), is killed with its process group once stopped for ``stop_s`` (the run it
was in is past its time limit when that was as long: :data:`OVERDUE`); when the pool is done, a
child still stopped is killed at once. A worker whose thread has borne the same run's name for the
limit plus its grace (:func:`~kvfast.runtime.worker.grace`) is past it, however the run holds it (C
code that keeps the GIL, the run's own ``faulthandler`` watchdog, a name it gives its process: nothing
the run does in its worker switches the sweep's watch off), and is killed too (:data:`OVERDUE`). The
pool sees a dead worker (see :mod:`kvfast.sweep.backends.pool` for what becomes of its runs). Only
the sweep's own child processes are ever killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import sys
import threading
import time

from kvfast.runtime.worker import WORKER_NAME, grace, prctl, worker_start

LINUX = sys.platform.startswith("linux")
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
_WORKER: list[int] = []  # [pid] once this process is set up as a pool worker
_KEEPER: list[int] = []  # [pid] of the worker's keeper (see worker_setup)


def in_worker() -> bool:
    """True in a pool worker set up by :func:`worker_setup` (not in a process it forked)."""
    return bool(_WORKER) and _WORKER[0] == os.getpid()


def worker_setup(parent: int | None = None) -> None:
    """A pool worker's initializer (idempotent): :func:`worker_start`, its own process group, a subreaper."""
    worker_start(parent)
    if in_worker():
        return
    _WORKER[:] = [os.getpid()]
    if not LINUX:
        return
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    with contextlib.suppress(OSError, ValueError):
        signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # a background group may still write to the terminal
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    # the worker's keeper: a process of its group that kills the group when the worker dies. However the worker
    # dies (killed by the sweep, a crash, or by the kernel because the sweep was killed with ``kill -9``), the
    # kernel sends the keeper SIGTERM (PR_SET_PDEATHSIG) and it kills the whole group: what the worker's runs
    # left running dies with the worker. The keeper runs no kvfast code after the fork.
    worker = os.getpid()
    if os.getpgid(0) != worker:  # not the leader of its own group: the group is not the worker's to kill
        return
    try:
        pid = os.fork()
    except OSError:
        return
    if pid:
        _KEEPER[:] = [pid]
        return
    try:
        signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != worker:  # the worker died before the line above
            os.killpg(0, signal.SIGKILL)
        while True:
            signal.pause()
    finally:
        os._exit(0)


class RunTree:
    """The processes one run starts, ended when it ends (:meth:`end`), outside a pool worker too.

    ``reap`` false: nothing is done. In a process that is not a pool worker (``--jobs 1``,
    the warm-up), this process is a child subreaper for the run's duration only
    (as it was before, after it), so that the run's detached grandchildren are found.
    """

    def __init__(self, reap: bool) -> None:
        self.reap = reap and LINUX
        alone = self.reap and not in_worker()
        self.before = _run_children() if alone else set(_KEEPER)  # a worker's own: its keeper
        self.was: int | None = None
        if alone:
            flag = ctypes.c_int(0)
            prctl(PR_SET_CHILD_SUBREAPER + 1, ctypes.byref(flag))  # PR_GET_CHILD_SUBREAPER
            self.was = flag.value
            prctl(PR_SET_CHILD_SUBREAPER, 1)

    def end(self) -> None:
        """Kill every child of this process not there before the run, with all its descendants, and reap them.

        In a subreaper the orphans that killing re-parents here are found and killed too,
        until none is left (a few rounds at most). Only the main thread's and the calling
        thread's children are looked at (one or two reads a run): a child forked by another
        thread the run left running is not, but it is in the worker's process group, which
        the worker's keeper kills when the worker ends.
        """
        if self.reap and not _run_children() <= self.before:  # (the common case: no child left; no psutil)
            import psutil

            for _ in range(8):
                new = [p for pid in _run_children() - self.before if (p := _suppressed(psutil.Process, pid))]
                if not new:
                    break
                for proc in [*new, *(d for p in new for d in _suppressed(p.children, True) or ())]:
                    _suppressed(proc.kill)
                psutil.wait_procs(new)
        if self.was is not None:
            prctl(PR_SET_CHILD_SUBREAPER, self.was)


def _suppressed(call, *args):
    """``call(*args)``; ``None`` when the process is gone meanwhile (psutil)."""
    import psutil

    with contextlib.suppress(psutil.Error):
        return call(*args)
    return None


_LISTS: dict[tuple[int, int], int] = {}  # (pid, thread id) -> open fd of its children list, read with pread


def _run_children() -> set[int]:
    """This process's children listed under its main thread and the calling thread (where a run's are).

    The two lists stay open and are re-read with one ``pread`` each (a microsecond; psutil's
    ``children()`` scans every process, a millisecond)."""
    pid = os.getpid()
    found: set[int] = set()
    for task in {pid, threading.get_native_id()}:
        fd = _LISTS.get((pid, task))
        try:
            if fd is None:
                fd = _LISTS[(pid, task)] = os.open(f"/proc/{pid}/task/{task}/children", os.O_RDONLY)
            found.update(int(p) for p in os.pread(fd, 1 << 16, 0).split())
        except OSError:  # no such list (an old kernel): psutil, which reads every thread's
            if (fd := _LISTS.pop((pid, task), None)) is not None:
                os.close(fd)
            import psutil

            found.update(p.pid for p in psutil.Process().children())
    return found


def kill_worker(pid: int) -> None:
    """SIGKILL a worker's process group (itself and its runs' processes) if it leads one, else the worker."""
    with contextlib.suppress(OSError):
        (os.killpg if os.getpgid(pid) == pid else os.kill)(pid, signal.SIGKILL)


OVERDUE: set[str] = set()  # run id prefixes of the runs whose workers the Monitor killed past the run's limit
RUN_NAME = re.compile(rb"[0-9a-f]{15}")  # a pool worker's watch thread's name in a run with a time limit


def worker_name(pid: int, tid: int) -> bytes | None:
    """The name of thread ``tid`` of process ``pid`` if it is a pool worker's watch thread (a run's name or
    :data:`~kvfast.runtime.worker.WORKER_NAME`); ``None`` for another thread, or one that is gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/comm", "rb") as f:
            name = f.read().rstrip(b"\n")
    except OSError:
        return None
    return name if name == WORKER_NAME or RUN_NAME.fullmatch(name) else None


class Monitor:
    """The sweep process's watch over its workers (see the module docstring); a context manager.

    ``seconds``: the runs' time limit; a worker killed after being stopped that long, or whose watch thread has
    borne the same run's name for ``seconds`` plus its grace, is in a run past it: that name, the run id's first
    15 digits, goes into :data:`OVERDUE`."""

    def __init__(self, stop_s: float, seconds: float | None = None) -> None:
        self.stop_s, self.seconds = stop_s, seconds
        self.done = threading.Event()
        self.stopped_since: dict[int, float] = {}
        self.threads: dict[int, int] = {}  # a pool worker's pid -> its watch thread's id
        self.runs: dict[int, tuple[str, float]] = {}  # a pool worker's pid -> (its run's name, when first seen)
        self.thread = threading.Thread(target=self.loop, name="kvfast-monitor", daemon=True)

    def __enter__(self) -> Monitor:
        OVERDUE.clear()
        if LINUX:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        if self.thread.is_alive():
            self.thread.join()
            with contextlib.suppress(OSError):
                self.check(time.monotonic(), final=True)

    def loop(self) -> None:
        while not self.done.wait(0.5):
            with contextlib.suppress(OSError):
                self.check(time.monotonic())

    def check(self, now: float, final: bool = False) -> None:
        """One look at every child: kill those stopped for ``stop_s`` (``final``: every stopped one) and the
        workers in a run past its limit and grace."""
        import psutil

        children = psutil.Process().children()
        for gone in set(self.threads) - {proc.pid for proc in children}:
            self.threads.pop(gone)  # (its pid may come back as another child's)
            self.runs.pop(gone, None)
        for proc in children:
            run = self.in_run(proc.pid, now)
            if _suppressed(proc.status) not in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                self.stopped_since.pop(proc.pid, None)
                if run is None or not self.seconds or now - run[1] <= self.seconds + grace(self.seconds):
                    continue
            elif not final and now - self.stopped_since.setdefault(proc.pid, now) <= self.stop_s:
                continue
            elif not self.seconds or now - self.stopped_since.get(proc.pid, now) < self.seconds:
                run = None  # stopped, but not for as long as a run's limit
            if run is not None:
                OVERDUE.add(run[0])
            kill_worker(proc.pid)
            self.stopped_since.pop(proc.pid, None)
            self.runs.pop(proc.pid, None)

    def in_run(self, pid: int, now: float) -> tuple[str, float] | None:
        """The run pool worker ``pid`` is in: its name and when this watch first saw it; ``None`` between runs,
        and for a child that is not a pool worker (no thread that kvfast names)."""
        name = worker_name(pid, self.threads[pid]) if pid in self.threads else None
        if name is None:  # not found yet (or gone): look at every thread of the process
            with contextlib.suppress(OSError):
                for tid in map(int, os.listdir(f"/proc/{pid}/task")):
                    if tid != pid and (name := worker_name(pid, tid)) is not None:
                        self.threads[pid] = tid
                        break
        if name is None or name == WORKER_NAME:
            self.runs.pop(pid, None)
            return None
        if self.runs.get(pid, ("",))[0] != name.decode():
            self.runs[pid] = (name.decode(), now)
        return self.runs[pid]
