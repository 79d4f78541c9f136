"""Issue 29: a Dask worker running another kvfast (or another version of the study) is refused before it runs
anything, in one line naming it and both versions; the manifest records each worker's versions.

A real scheduler and two workers (``--no-nanny``: the worker is the process started here, so its pid is known);
one preloads tests/fake_kvfast_version.py, which makes it report kvfast ``0.0.0-other``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from kvfast._version import __version__

pytest.importorskip("distributed")

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}


def start(*argv: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", *argv], env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip


def wait_for_workers(address: str, n: int, limit: float = 120) -> None:
    from distributed import Client

    with Client(address, timeout="30s") as client:
        client.wait_for_workers(n, timeout=limit)


def test_a_worker_of_another_kvfast_is_refused_and_the_manifest_records_every_worker(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {**ENV, "KVFAST_FAULT_MARKS": str(marks)}
    procs = [
        start("distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
              "--scheduler-file", str(tmp_path / "s.json"), env=env)
    ]  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "s.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        address = json.loads((tmp_path / "s.json").read_text())["address"]
        worker = ["distributed.cli.dask_worker", address, "--nthreads", "1", "--no-nanny", "--no-dashboard"]
        good = start(*worker, "--name", "same", env=env)
        other = start(*worker, "--name", "other", "--preload", "fake_kvfast_version", env=env)
        procs += [good, other]
        wait_for_workers(address, 2)
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
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
