"""Dask clusters of separate processes, started as a batch job starts them (a scheduler, then workers given its
address): issue 46, a grid run on such a cluster stores the rows a local run stores, and nothing is left running;
issue 29, a worker running another kvfast (or another version of the study) is refused before it runs anything, in
one line naming it and both versions; the manifest records each worker's versions.

A real scheduler on 127.0.0.1 at a port the system picks (read from its scheduler file), real workers; each process
in its own session, killed with it at the end. In the issue 29 test the workers run without a nanny (the worker is
the process started here, so its pid is known); one preloads tests/fake_kvfast_version.py, which makes it report
kvfast ``0.0.0-other``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import psutil
import pytest
from shared import ROOT, TESTS, environment

from kvfast._version import __version__
from kvfast.sweep import MANIFEST, load

pytestmark = pytest.mark.subprocess  # every test here starts a Python process

pytest.importorskip("distributed")

ENV = environment(TESTS)


def start(*argv: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", *argv], env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip


def wait_for_workers(address: str, n: int, limit: float = 120) -> None:
    from distributed import Client

    with Client(address, timeout="30s") as client:
        client.wait_for_workers(n, timeout=limit)


def in_sessions(sessions: set[int]) -> list[psutil.Process]:
    """The processes, not yet reaped zombies, still in these sessions."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(p.pid) in sessions and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
    return found


@contextlib.contextmanager
def cluster(folder: Path, env: dict, *workers: tuple[str, ...]) -> Iterator[tuple[str, list[subprocess.Popen]]]:
    """A scheduler (``dask scheduler``) on 127.0.0.1 at a free port and one worker (``dask worker ADDRESS``) per
    tuple of extra worker arguments, once all have joined: ``(address, worker processes)``. On the way out every
    process's session is killed, each process waited for, and no process of theirs may be left."""
    file = folder / "scheduler.json"
    procs = [
        start("distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
              "--scheduler-file", str(file), env=env)
    ]  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):  # not there yet, or still being written (a loaded machine)
                address = json.loads(file.read_text())["address"]
                break
            time.sleep(0.1)
        else:
            address = json.loads(file.read_text())["address"]
        for extra in workers:
            procs.append(start("distributed.cli.dask_worker", address, "--nthreads", "1", "--no-dashboard", *extra,
                               env=env))  # fmt: skip
        wait_for_workers(address, len(workers))
        yield address, procs[1:]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait(timeout=30)
        deadline = time.monotonic() + 30
        while (left := in_sessions({p.pid for p in procs})) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, left


def test_a_grid_on_a_cluster_of_separate_processes_stores_a_local_runs_rows(tmp_path):
    grid = ROOT / "examples" / "sum_order.toml"  # a user's study: the workers import it from their working directory
    base = [sys.executable, "-m", "kvfast.cli", "run", str(grid), "--quiet"]
    local = subprocess.Popen([*base, "--out", str(tmp_path / "local"), "--jobs", "1"], env=ENV, cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    with cluster(tmp_path, ENV, (), ()) as (address, _):  # two workers, each with its nanny, as a job script starts
        assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", address), address
        proc = subprocess.run([*base, "--out", str(tmp_path / "dask"), "--backend", "dask", "--scheduler", address],
                              env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
    out, err = local.communicate(timeout=300)
    assert local.returncode == 0, out + err
    history = json.loads((tmp_path / "dask" / MANIFEST).read_text())["history"]
    assert history[-1]["backend"] == "dask" and len(history[-1]["worker_versions"]) == 2, history[-1]
    on_dask, here = (load(tmp_path / d).drop(columns="wall_s") for d in ("dask", "local"))
    assert len(here) == 360 and (here["status"] == "ok").all()
    pd.testing.assert_frame_equal(on_dask, here, check_exact=True)


def test_a_worker_of_another_kvfast_is_refused_and_the_manifest_records_every_worker(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {**ENV, "KVFAST_FAULT_MARKS": str(marks)}
    same = ("--no-nanny", "--name", "same")
    another = ("--no-nanny", "--name", "other", "--preload", "fake_kvfast_version")
    with cluster(tmp_path, env, same, another) as (address, (good, other)):
        toml = tmp_path / "g.toml"
        toml.write_text('study = "faultstudy:STUDY"\n[axes]\nx = [0, 1, 2, 3, 4, 5]\nmode = ["slow"]\n')
        out = tmp_path / "o"
        cmd = [sys.executable, "-m", "kvfast.cli", "run", str(toml), "--out", str(out), "--backend", "dask"]
        proc = subprocess.run([*cmd, "--scheduler", address, "--quiet"], env=env, cwd=ROOT, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines = [ln for ln in proc.stderr.splitlines() if "refused" in ln]
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert f"it runs kvfast 0.0.0-other, this client kvfast {__version__}; no run goes to it" in lines[0]
        assert lines[0].startswith("kvfast: Dask worker tcp://")
        # no run went to the refused worker (each `slow` run marks the pid of the process that ran it)
        pids = {int(p.read_text()) for p in marks.glob("started-*")}
        assert other.pid not in pids and good.pid in pids, (pids, good.pid, other.pid)
        assert (pd.read_parquet(out)["status"] == "ok").all() and len(pd.read_parquet(out)) == 6
        history = json.loads((out / "_sweep.json").read_text())["history"]
        seen = history[-1]["worker_versions"]
        assert sorted(v["kvfast"] for v in seen.values()) == sorted(["0.0.0-other", __version__])
        assert [v["refused"] for v in seen.values() if v["kvfast"] == "0.0.0-other"] == [True]
        assert all(v["study_version"] == "1" for v in seen.values())
        # with only the other kvfast left, nothing runs: one line, exit 2
        os.killpg(good.pid, signal.SIGKILL)
        good.wait()
        deadline = time.monotonic() + 60
        again = None
        while time.monotonic() < deadline:  # until the scheduler has noticed the worker gone
            again = subprocess.run([*cmd, "--scheduler", address, "--quiet", "--fresh"], env=env, cwd=ROOT,
                                   capture_output=True, text=True, timeout=300)  # fmt: skip
            if again.returncode == 2:
                break
        assert again.returncode == 2, again.stdout + again.stderr
        assert "every worker was refused" in again.stderr and "0.0.0-other" in again.stderr
        assert "Traceback" not in again.stderr
