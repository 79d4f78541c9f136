"""The warm-up: one pending run in the sweep's own process before any worker starts (its compiles, which forked
workers inherit), never a run that has killed a process; the numbers never depend on it or on the worker count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from kvfast.studies import STUDIES
from kvfast.studies.common import require_config_choice
from kvfast.sweep import grid_from_spec, load, run_sweep
from kvfast.sweep.grid import GridRun
from kvfast.sweep.plan import split_warmup
from kvfast.sweep.study import Study
from kvfast.validation import require_int

MARKS = "KVFAST_WARMUP_TEST_MARKS"


def _validate(config: dict) -> None:
    require_int(config.get("x"), "x", 0)
    require_config_choice(config, "kind", ("a", "b", "c"))
    require_config_choice(config, "mode", ("ok", "crash"))


def _run(config: dict) -> dict:
    """Every ``b`` run marks its start. ``crash``: kills its process. Returns the pid it ran in."""
    folder = Path(os.environ[MARKS])
    if config["kind"] == "b":
        (folder / f"b-{os.getpid()}").write_text("")
    if config["mode"] == "crash":
        os._exit(7)
    return {"pid": os.getpid(), "seen": True, "y": float(np.sum(np.random.default_rng(config["x"]).random(5)))}


STUDY = Study(
    name="warmuptest",
    version="1",
    description="test-only study: runs of three kinds",
    run=_run,
    config_fields={"x": pa.int64(), "kind": pa.string(), "mode": pa.string()},
    result_fields={"pid": pa.int64(), "seen": pa.bool_(), "y": pa.float64()},
    validate_config=_validate,
    summarize=lambda df: df.groupby("kind").size().reset_index(name="runs"),
)


from shared import ROOT, TESTS, environment  # noqa: E402

SWEEP = r"""
import json, sys
import kvfast.studies
from kvfast.sweep import grid_from_spec, run_sweep
report = run_sweep(grid_from_spec(json.loads(sys.argv[1])), sys.argv[2], jobs=2, backend="fork", quiet=True)
print(json.dumps({"ran": report.ran, "ok": report.ok, "counts": report.counts}))
"""


def sweep_in_a_fresh_process(spec: dict, out: Path) -> dict:
    """A 2-worker fork sweep of ``spec`` in a fresh interpreter: its workers fork only where no fork-unsafe library
    (torch, imported by other test modules of a session) is loaded. Its report's ran, ok and counts."""
    env = environment(TESTS, Path(__file__).parent)  # this module (whose STUDY the grid names) and what it imports
    proc = subprocess.run(
        [sys.executable, "-c", SWEEP, json.dumps(spec), str(out)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def study(monkeypatch, tmp_path):
    monkeypatch.setitem(STUDIES, "warmuptest", STUDY)
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv(MARKS, str(marks))
    return STUDY


def _spec(union: list[dict]) -> dict:
    return {"study": "test_sweep_warmup:STUDY", "union": union}


def _one(x: int, kind: str, mode: str = "ok") -> dict:
    """A union member of one run."""
    return {"axes": {"x": [x], "kind": [kind], "mode": [mode]}}


def _runs(kinds: str) -> list[GridRun]:
    return [GridRun(f"r{i}", {"x": i, "kind": k}) for i, k in enumerate(kinds)]


def test_split_warmup_takes_the_first_run_and_keeps_every_other_run_in_order():
    runs = _runs("aabacbc")
    first, rest = split_warmup(iter(runs), set())
    assert [r.run_id for r in first] == ["r0"]
    assert [r.run_id for r in rest] == [r.run_id for r in runs[1:]]


def test_split_warmup_never_takes_a_run_that_killed_a_process_and_looks_only_so_far():
    runs = _runs("abcab")
    first, rest = split_warmup(iter(runs), {"r0", "r2"})
    assert [r.run_id for r in first] == ["r1"]
    assert [r.run_id for r in rest] == ["r0", "r2", "r3", "r4"]
    first, rest = split_warmup(iter(runs), {"r0", "r1"}, look=2)
    assert first == [] and [r.run_id for r in rest] == ["r0", "r1", "r2", "r3", "r4"]


@pytest.mark.subprocess
def test_a_run_that_kills_its_worker_is_a_crashed_row_and_the_sweep_goes_on(tmp_path, study):
    grid = grid_from_spec(_spec([_one(0, "a"), _one(1, "b", "crash"), _one(2, "a"), _one(3, "b"), _one(4, "c")]))
    report = sweep_in_a_fresh_process(grid.spec, tmp_path / "c")
    assert report["counts"] == {"ok": 4, "error": 0, "crashed": 1, "timeout": 0}
    df = load(tmp_path / "c").set_index("x")
    assert df.loc[1, "status"] == "crashed" and (df.drop(index=1)["status"] == "ok").all()
    assert df.loc[0, "pid"] != df.loc[2, "pid"]  # the warm-up here, the rest in workers
    # a rerun does not warm up on the crashed run (it is avoided), nor run it again without --retry-errors
    assert run_sweep(grid, tmp_path / "c", jobs=2, quiet=True).ran == 0


@pytest.mark.parametrize("backend", ["loky", "threading"])
def test_other_backends_warm_up_one_run(tmp_path, study, backend):
    grid = grid_from_spec({"study": "warmuptest", "axes": {"x": [1, 2, 3], "kind": ["a", "b"], "mode": ["ok"]}})
    report = run_sweep(grid, tmp_path / backend, jobs=2, backend=backend, quiet=True)
    assert report.ok and report.ran == 6


def _numbers(df: pd.DataFrame) -> pd.DataFrame:
    out = df.drop(columns=["wall_s"]).reset_index(drop=True)
    for c in out.columns:
        if out[c].dtype == np.float64:
            out[c] = out[c].to_numpy().view(np.int64)
    return out


@pytest.mark.subprocess
def test_two_workers_on_runs_that_compile_different_code_give_one_workers_bits(tmp_path):
    """f64, f32 and bf16 runs compile different kernels (the warm-up one format, the workers the others): every
    number two workers store is the one worker's, bit for bit."""
    spec = {
        "study": "exactness",
        "fixed": {"vocab": 32, "d_model": 16, "d_ff": 32, "n_head": 2, "steps": 5, "prompt_len": 3},
        "axes": {
            "seed": [0, 1],
            "n_layer": [1, 2],
            "order": ["sequential", "pairwise"],
            "preset": ["f64", "f32", "bf16"],
        },
    }
    grid = grid_from_spec(spec)
    assert {r.config["preset"] for r in grid.runs} == {"f64", "f32", "bf16"}
    report = run_sweep(grid, tmp_path / "one", jobs=1, quiet=True)
    assert report.ok and report.ran == len(grid) == 24
    two = sweep_in_a_fresh_process(spec, tmp_path / "two")
    assert two["ok"] and two["ran"] == 24
    frames = [_numbers(load(tmp_path / name)) for name in ("one", "two")]
    pd.testing.assert_frame_equal(frames[0], frames[1], check_exact=True)
    assert frames[0]["tokens"].nunique() > 1


# -- a kernel compiled when called: one compile for processes sharing a cache --------------------------

KERNEL = """
import numba as nb
from kvfast.kernels.indirect import one_compile_at_a_time

def plain(x):
    s = 0.0
    for i in range(x.size):
        s += x[i] * 0.5
    return s

def plain2(x):
    s = 0.0
    for i in range(x.size):
        s += x[i] * 0.5
    return s

locked = one_compile_at_a_time(nb.njit(cache=True)(plain))
unlocked = nb.njit(cache=True)(plain2)
"""

TWO_AT_ONCE = r"""
import json, sys, time
import numpy as np
import twokernel
kernel = getattr(twokernel, sys.argv[1])
while time.time() < float(sys.argv[2]):  # both processes call it for the first time at the same moment
    time.sleep(0.005)
assert kernel(np.arange(4.0)) == 3.0
print(json.dumps([sum(kernel.stats.cache_hits.values()), sum(kernel.stats.cache_misses.values())]))
"""


@pytest.mark.subprocess
def test_two_processes_calling_a_kernel_compiled_one_at_a_time_compile_it_once(tmp_path):
    """Workers that meet a kernel the warm-up did not compile call it at about the same moment: the first
    compiles, the other waits and loads it (``kvfast.kernels.indirect.one_compile_at_a_time``); the control
    (no lock) compiles twice, so the check can fail."""
    (tmp_path / "twokernel.py").write_text(textwrap.dedent(KERNEL))
    root = ROOT
    results = {}
    for name in ("locked", "unlocked"):
        env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{root}", "NUMBA_CACHE_DIR": str(tmp_path / name)}
        start = f"{time.time() + 3.0}"
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", TWO_AT_ONCE, name, start], stdout=subprocess.PIPE, text=True, env=env
            )  # fmt: skip
            for _ in range(2)
        ]
        results[name] = sorted(json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs)
    assert results["locked"] == [[0, 1], [1, 0]]
    assert results["unlocked"] == [[0, 1], [0, 1]]
