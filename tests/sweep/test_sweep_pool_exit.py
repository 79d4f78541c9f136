"""Issue 40: a traceback at exit after a sweep that succeeded (``concurrent.futures.process._python_exit`` ->
``OSError: [Errno 9] Bad file descriptor``). CPython 3.11's exit hook for process pools writes, without a lock,
to the wake-up pipe of every listed manager thread, while a pool shut down without waiting may be closing it;
``kvfast.sweep.backends.pool.shutdown`` returns only once the pool's manager thread has ended (or is off the
hook's list). These tests read CPython's private names on purpose: they fail when CPython moves them."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import process

import pytest
from shared import ROOT

from kvfast.sweep.backends import pool as pools
from kvfast.sweep.procs import kill_worker

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork pools"), pytest.mark.subprocess]


def busy_pool():
    """A kvfast fork pool whose one worker runs a task that does not end by itself, its manager thread, and its
    workers' pids."""
    pool = pools.new_pool("fork", 1)
    pool.submit(time.sleep, 600)
    return pool, pool._executor_manager_thread, [p.pid for p in pool._processes.values()]


def end(pool, manager: threading.Thread, pids: list[int]) -> None:
    for pid in pids:
        kill_worker(pid)
    pool.shutdown(wait=False)
    manager.join(timeout=60)
    assert not manager.is_alive()


def test_the_cpython_names_shutdown_relies_on_are_there():
    """A live pool's manager thread is ``_executor_manager_thread``, listed in ``_threads_wakeups`` (the exit hook's
    list), and ``shutdown(wait=False)`` forgets it (why kvfast reads it first)."""
    pool, manager, pids = busy_pool()
    try:
        assert isinstance(manager, threading.Thread) and manager.is_alive()
        assert pids and all(pool._processes[pid].pid == pid for pid in pids)  # what shutdown(kill=True) kills
        assert isinstance(process._threads_wakeups[manager], process._ThreadWakeup)
        pool.shutdown(wait=False, cancel_futures=True)
        assert pool._executor_manager_thread is None
    finally:
        end(pool, manager, pids)


def test_a_killed_pools_manager_thread_is_no_longer_alive_and_listed_when_shutdown_returns():
    pool, manager, pids = busy_pool()
    try:
        pools.shutdown(pool, kill=True)
        assert not (manager.is_alive() and manager in process._threads_wakeups)
    finally:
        end(pool, manager, pids)


def test_control_a_pool_shut_down_without_waiting_leaves_its_manager_thread_alive_and_listed():
    """The state the test above rules out: ``shutdown(wait=False)`` (what a kill does) returns at once."""
    pool, manager, pids = busy_pool()
    try:
        pool.shutdown(wait=False, cancel_futures=True)
        assert manager.is_alive() and manager in process._threads_wakeups
    finally:
        end(pool, manager, pids)


# The race made certain: the exit hook's wake-up pauses between its check that the pipe is open and its write
# until the manager thread has closed the pipe; the manager thread's close waits (at most 3 s) for the hook's check.
EXIT = """
import sys, threading
from concurrent.futures import process
from kvfast.sweep.backends import pool as pools
from kvfast.sweep.procs import kill_worker

checked, closed = threading.Event(), threading.Event()
wakeup, close = process._ThreadWakeup.wakeup, process._ThreadWakeup.close

def hook_wakeup(self):
    if not (process._global_shutdown and not self._closed):
        return wakeup(self)
    print("the exit hook writes to an open pipe", flush=True)
    checked.set()
    closed.wait(30)
    self._writer.send_bytes(b"")

def slow_close(self):
    checked.wait(3)
    close(self)
    closed.set()

process._ThreadWakeup.wakeup, process._ThreadWakeup.close = hook_wakeup, slow_close
pool = pools.new_pool("fork", 2)
assert pool.submit(abs, -1).result() == 1
if sys.argv[1] == "kvfast":
    pools.shutdown(pool, kill=True)
else:  # kvfast's kill before issue 40: the workers killed, shutdown without waiting
    for p in list(pool._processes.values()):
        kill_worker(p.pid)
    pool.shutdown(wait=False, cancel_futures=True)
"""


@pytest.mark.parametrize("how", ["kvfast", "control"])
def test_no_traceback_at_exit_after_a_pool_is_killed(how):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", EXIT, how], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    if how == "kvfast":
        assert (proc.stdout, proc.stderr) == ("", "")
    else:
        assert proc.stdout == "the exit hook writes to an open pipe\n"
        assert "in _python_exit" in proc.stderr and "OSError" in proc.stderr, proc.stderr


def test_loky_names_its_workers_as_shutdown_kills_them():
    """``shutdown(pool, kill=True)`` kills loky's workers by the same private name, ``_processes`` (pid -> process);
    the control: the worker was alive before, so the kill can be seen."""
    import psutil

    def alive(pid: int) -> bool:
        return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE

    pool = pools.new_pool("loky", 1)
    pool.submit(time.sleep, 600)
    deadline = time.monotonic() + 60
    while not pool._processes and time.monotonic() < deadline:
        time.sleep(0.05)
    (pid,) = pool._processes
    assert pool._processes[pid].pid == pid and alive(pid)
    pools.shutdown(pool, kill=True)
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)
