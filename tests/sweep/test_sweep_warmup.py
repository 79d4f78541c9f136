"""The warm-up with a study's ``compile_key``: one run per key, at the same time, in helper processes.

The contract (:attr:`kvfast.sweep.study.Study.compile_key`): runs of different keys may compile different
code, so a sweep with several workers (``fork``) warms up one run of each key side by side before the rest;
a bad key is a ``ValueError`` naming ``compile_key``; the numbers never depend on it.
"""

from __future__ import annotations

import dataclasses
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
from shared import ROOT, TESTS, environment

from kvfast.studies import STUDIES
from kvfast.studies.base import Study
from kvfast.studies.common import require_config_choice
from kvfast.sweep import ResultsDir, grid_from_spec, load, run_sweep
from kvfast.sweep.grid import Run
from kvfast.sweep.plan import split_warmup
from kvfast.validation import require_int

MARKS = "KVFAST_WARMUP_TEST_MARKS"


def _validate(config: dict) -> None:
    require_int(config.get("x"), "x", 0)
    require_config_choice(config, "kind", ("a", "b", "c"))
    require_config_choice(config, "mode", ("ok", "wait", "crash"))


def _run(config: dict) -> dict:
    """``wait``: wait (up to 60 s) for the first run of kind ``b`` to have started (``seen``: it had); every
    ``b`` run marks its start. ``crash``: kills its process. Returns the pid it ran in."""
    folder = Path(os.environ[MARKS])
    seen = True
    if config["kind"] == "b":
        (folder / f"b-{os.getpid()}").write_text("")
    if config["mode"] == "crash":
        os._exit(7)
    if config["mode"] == "wait":
        deadline = time.monotonic() + 60
        while not (seen := any(folder.glob("b-*"))) and time.monotonic() < deadline:
            time.sleep(0.01)
    return {"pid": os.getpid(), "seen": seen, "y": float(np.sum(np.random.default_rng(config["x"]).random(5)))}


def _key(config: dict):
    return config["kind"]


STUDY = Study(
    name="warmuptest",
    version="1",
    description="test-only study: runs of three compile keys",
    run=_run,
    config_fields={"x": pa.int64(), "kind": pa.string(), "mode": pa.string()},
    result_fields={"pid": pa.int64(), "seen": pa.bool_(), "y": pa.float64()},
    validate_config=_validate,
    summarize=lambda df: df.groupby("kind").size().reset_index(name="runs"),
    compile_key=_key,
)


SWEEP = r"""
import json, sys
import kvfast.studies
from kvfast.sweep import grid_from_spec, run_sweep
report = run_sweep(grid_from_spec(json.loads(sys.argv[1])), sys.argv[2], jobs=2, backend="fork", quiet=True)
print(json.dumps({"ran": report.ran, "ok": report.ok, "counts": report.counts}))
"""


def sweep_in_a_fresh_process(spec: dict, out: Path) -> dict:
    """A 2-worker fork sweep of ``spec`` in a fresh interpreter: helpers fork only where no fork-unsafe library
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


# -- the contract: the hook's value --------------------------------------------------------------------


def test_compile_key_must_be_a_function_or_none():
    with pytest.raises(ValueError, match=r"^compile_key: 3 is not allowed; allowed: None or a function"):
        dataclasses.replace(STUDY, compile_key=3)
    assert dataclasses.replace(STUDY, compile_key=None).compile_key is None


def _runs(kinds: str) -> list[Run]:
    return [Run(f"r{i}", {"x": i, "kind": k}) for i, k in enumerate(kinds)]


def test_split_warmup_takes_one_run_per_key_and_keeps_every_other_run_in_order():
    runs = _runs("aabacbc")
    first, others, rest = split_warmup(iter(runs), set(), key=_key, most=2)
    assert [r.run_id for r in first] == ["r0"]
    assert [r.run_id for r in others] == ["r2", "r4"]  # the first b, the first c
    assert [r.run_id for r in rest] == ["r1", "r3", "r5", "r6"]
    # at most one other key per helper process (two workers: one)
    first, others, rest = split_warmup(iter(runs), set(), key=_key, most=1)
    assert [r.run_id for r in first + others] == ["r0", "r2"]
    assert [r.run_id for r in rest] == ["r1", "r3", "r4", "r5", "r6"]
    # no key: one warm-up run, as before
    first, others, rest = split_warmup(iter(runs), set())
    assert [r.run_id for r in first] == ["r0"] and others == []
    assert [r.run_id for r in rest] == [r.run_id for r in runs[1:]]


def test_split_warmup_never_takes_a_run_that_killed_a_process_and_looks_only_so_far():
    runs = _runs("abcab")
    first, others, rest = split_warmup(iter(runs), {"r0", "r2"}, key=_key, most=2)
    assert [r.run_id for r in first] == ["r1"] and [r.run_id for r in others] == ["r3"]
    assert [r.run_id for r in rest] == ["r0", "r2", "r4"]
    first, others, rest = split_warmup(iter(runs), set(), look=2, key=_key, most=2)
    assert [r.run_id for r in first + others] == ["r0", "r1"]
    assert [r.run_id for r in rest] == ["r2", "r3", "r4"]


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (lambda c: [c["kind"]], r"^compile_key: \['a'\] \(for run r0\) is not allowed; allowed: a hashable value"),
        (lambda c: c["missing"], r"^compile_key: raised KeyError: 'missing' for run r0; allowed: a function"),
    ],
)
def test_a_bad_key_is_a_value_error_naming_compile_key(key, message):
    with pytest.raises(ValueError, match=message):
        split_warmup(iter(_runs("ab")), set(), key=key)


def test_a_bad_key_stops_the_sweep_before_any_run(tmp_path, study, monkeypatch):
    monkeypatch.setitem(STUDIES, "warmuptest", dataclasses.replace(study, compile_key=lambda c: {c["kind"]}))
    grid = grid_from_spec({"study": "warmuptest", "axes": {"x": [1, 2], "kind": ["a", "b"], "mode": ["ok"]}})
    for jobs in (1, 2):  # whatever the worker count and backend
        with pytest.raises(ValueError, match=r"^compile_key: \{'a'\} \(for run \w+\) is not allowed"):
            run_sweep(grid, tmp_path / "bad", jobs=jobs, backend="fork", quiet=True)
    assert not list((tmp_path / "marks").iterdir())  # no run ran (a b run marks its start)
    assert len(ResultsDir(tmp_path / "bad").stored_index()) == 0
    assert not (tmp_path / "bad" / ".warmup").exists()


# -- the warm-up: side by side -------------------------------------------------------------------------


@pytest.mark.subprocess
def test_the_warm_ups_of_different_keys_run_at_the_same_time_in_different_processes(tmp_path, study):
    """The first run (kind a) waits for the first b run to start: it sees it only if that run's warm-up runs
    alongside (without a key, the b run would start after the first run returned: ``seen`` False after 60 s)."""
    grid = grid_from_spec(_spec([_one(0, "a", "wait"), _one(1, "a"), _one(2, "b"), _one(3, "c")]))
    assert len(grid) == 4
    report = sweep_in_a_fresh_process(grid.spec, tmp_path / "w")
    assert report["ok"] and report["ran"] == 4
    df = load(tmp_path / "w").set_index("x")
    assert df.loc[0, "seen"]  # the sweep's own warm-up, which saw b's start
    assert df.loc[2, "pid"] != df.loc[0, "pid"]  # b's warm-up: a helper process
    assert len(list((tmp_path / "marks").glob("b-*"))) == 1  # b ran once


@pytest.mark.subprocess
def test_a_helper_warm_up_that_kills_its_process_is_a_crashed_row_and_the_sweep_goes_on(tmp_path, study):
    grid = grid_from_spec(_spec([_one(0, "a"), _one(1, "b", "crash"), _one(2, "a"), _one(3, "b"), _one(4, "c")]))
    report = sweep_in_a_fresh_process(grid.spec, tmp_path / "c")
    assert report["counts"] == {"ok": 4, "error": 0, "crashed": 1, "timeout": 0}
    df = load(tmp_path / "c").set_index("x")
    assert df.loc[1, "status"] == "crashed" and (df.drop(index=1)["status"] == "ok").all()
    # a rerun does not warm up on the crashed run (it is avoided), nor run it again without --retry-errors
    assert run_sweep(grid, tmp_path / "c", jobs=2, quiet=True).ran == 0


@pytest.mark.subprocess
@pytest.mark.parametrize("backend", ["loky", "threading"])
def test_other_backends_warm_up_one_run_as_without_a_key(tmp_path, study, backend):
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
    """The exactness study keys its runs on their formats (f64, f32 and bf16 compile different kernels): two
    workers warm up side by side, and every number is the one worker's, bit for bit."""
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
    keys = {grid.study.compile_key(r.config) for r in grid.runs}
    assert keys == {("f64", "f64", "standard"), ("f32", "f32", "standard"), ("bf16", "f32", "standard")}
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
    """Warm-ups side by side call the compiled forward and decode at about the same moment: the first
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
