"""The sweep engine through its API: identical results across backends, resume, error and crash rows, lock."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvfast.studies import STUDIES
from kvfast.sweep import ResultsDir, grid_from_spec, load, run_sweep
from kvfast.sweep.study import Study
from kvfast.validation import require_choice, require_int

# -- a tiny test-only study ----------------------------------------------------------------------------


def _validate(config: dict) -> None:
    require_int(config.get("x"), "x", 0)
    # kvfast.validation's check, not kvfast.studies': a worker unpickling this function imports no study
    require_choice(config.get("mode"), "mode", ("ok", "raise", "crash", "badtype", "pid"))
    if not isinstance(config.get("scale"), float):
        raise ValueError(f"scale: {config.get('scale')!r} is not allowed; allowed: a number")


def _run(config: dict) -> dict:
    if config["mode"] == "raise":
        raise RuntimeError(f"boom at x={config['x']}")
    if config["mode"] == "crash":
        os._exit(7)  # kills the worker process, as a segfault would
    if config["mode"] == "pid":  # where did this run execute?
        return {"y": float(os.getpid()), "n": 0, "idx": []}
    rng = np.random.default_rng([config["x"], 12345])
    values = rng.standard_normal(7) * config["scale"]
    y = float(np.sum(values / 3.0))
    if config["mode"] == "badtype":
        y = "not a float"
    return {"y": y, "n": int(values.argmax()), "idx": [int(i) for i in np.argsort(values)[:3]]}


TEST_STUDY = Study(
    name="sweeptest",
    version="1",
    description="test-only study",
    run=_run,
    config_fields={"x": pa.int64(), "scale": pa.float64(), "mode": pa.string()},
    result_fields={"y": pa.float64(), "n": pa.int64(), "idx": pa.list_(pa.int64())},
    validate_config=_validate,
    summarize=lambda df: df.groupby("mode").size().reset_index(name="runs"),
)


@pytest.fixture
def test_study(monkeypatch):
    """Register the test study; make this module picklable by value for worker processes."""
    import cloudpickle  # what loky and Dask pickle tasks with

    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)
    monkeypatch.setitem(STUDIES, "sweeptest", TEST_STUDY)
    yield TEST_STUDY
    cloudpickle.unregister_pickle_by_value(module)


@pytest.fixture(scope="module")
def dask_address():
    """One LocalCluster for the module, reached through ``scheduler=ADDRESS`` (the --scheduler path)."""
    import logging

    import dask
    from distributed import LocalCluster

    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        cluster = LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None, silence_logs=logging.ERROR
        )
    yield cluster.scheduler_address
    cluster.close()


def test_spec(xs, modes=("ok",), scale=(1, 2.5)) -> dict:
    return {"study": "sweeptest", "axes": {"x": list(xs), "scale": list(scale), "mode": list(modes)}}


test_spec.__test__ = False  # a helper, not a test

EXACT_SUB = {
    "study": "exactness",
    "fixed": {"vocab": 32, "d_model": 16, "d_ff": 32, "n_head": 2, "steps": 5},
    "axes": {
        "seed": [0, 1],
        "n_layer": [1, 2],
        "prompt_len": [3],
        "order": ["sequential", "pairwise"],
        "preset": ["f64", "f32", "bf16"],
    },
}


def store_schema() -> pa.Schema:
    from kvfast.sweep import schema_for

    return schema_for(TEST_STUDY)


def numeric_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Everything but timing, with floats as their bit patterns."""
    out = df.drop(columns=["wall_s"]).reset_index(drop=True)
    for c in out.columns:
        if out[c].dtype == np.float64:
            out[c] = out[c].to_numpy().view(np.int64)
    return out


@pytest.mark.subprocess
def test_identical_results_across_jobs_threading_and_dask(tmp_path, test_study, dask_address):
    exact = grid_from_spec(EXACT_SUB)
    mine = grid_from_spec(test_spec(range(12)))
    assert len(exact) == 24 and len(mine) == 24
    frames: dict[str, list[pd.DataFrame]] = {}
    variants = [
        ("jobs1", dict(jobs=1)),
        ("fork2", dict(jobs=2, backend="fork", chunk_size=3)),
        ("loky2", dict(jobs=2, backend="loky")),
        ("loky2-chunk1", dict(jobs=2, backend="loky", chunk_size=1)),
        ("threading2", dict(jobs=2, backend="threading", chunk_size=5)),
        ("dask2", dict(jobs=2, backend="dask", scheduler=dask_address)),
    ]
    for name, kwargs in variants:
        for grid in (exact, mine):
            out = tmp_path / f"{grid.study.name}-{name}"
            report = run_sweep(grid, out, quiet=True, **kwargs)
            assert report.ok and report.ran == len(grid), (name, report.line())
            df = load(out)
            assert list(df["run_id"]) == sorted(r.run_id for r in grid.runs)
            frames.setdefault(grid.study.name, []).append(numeric_frame(df))
    for study_frames in frames.values():
        for other in study_frames[1:]:
            pd.testing.assert_frame_equal(study_frames[0], other, check_exact=True)
    # the comparison is not vacuous: results differ between configs
    assert frames["sweeptest"][0]["y"].nunique() == 24
    assert frames["exactness"][0]["tokens"].nunique() > 1
    # and they are the run function's own numbers, attributed to the right config
    df = load(tmp_path / "sweeptest-dask2")
    for _, row in df.iterrows():
        expect = _run({"x": int(row["x"]), "scale": float(row["scale"]), "mode": row["mode"]})
        assert row["y"] == expect["y"] and list(row["idx"]) == expect["idx"]


@pytest.mark.subprocess
def test_resume_skips_ok_runs_and_extending_a_grid_reuses_them(tmp_path, test_study):
    out = tmp_path / "r"
    small = grid_from_spec(test_spec(range(4)))
    first = run_sweep(small, out, jobs=1, quiet=True)
    assert first.ran == 8 and first.ok
    again = run_sweep(small, out, jobs=1, quiet=True)
    assert again.ran == 0 and again.skipped == 8 and again.ok
    bigger = grid_from_spec(test_spec(range(6)))
    ext = run_sweep(bigger, out, jobs=2, quiet=True)
    assert ext.ran == 4 and ext.skipped == 8 and ext.ok
    df = load(out)
    assert len(df) == 12 and df["run_id"].is_unique
    assert len(pd.read_parquet(out)) == 12  # compacted: plain pandas sees one row per run
    fresh = run_sweep(small, out, jobs=1, quiet=True, fresh=True)
    assert fresh.ran == 8 and len(load(out)) == 8


@pytest.mark.subprocess
@pytest.mark.parametrize("backend", ["fork", "loky"])
def test_error_rows_crash_rows_and_retry_errors(tmp_path, test_study, backend):
    # crash and raise configs come after the first run (which runs in this process as warm-up)
    spec = {
        "study": "sweeptest",
        "fixed": {"scale": 1.0},
        "union": [
            {"axes": {"x": list(range(10)), "mode": ["ok"]}},
            {"axes": {"x": [100, 101], "mode": ["raise"]}},
            {"axes": {"x": [200], "mode": ["crash"]}},
            {"axes": {"x": [300], "mode": ["badtype"]}},
            {"axes": {"x": list(range(10, 20)), "mode": ["ok"]}},
        ],
    }
    grid = grid_from_spec(spec)
    out = tmp_path / "e"
    report = run_sweep(grid, out, jobs=2, quiet=True, chunk_size=3, backend=backend)
    assert not report.ok
    assert report.counts == {"ok": 20, "error": 3, "crashed": 1, "timeout": 0}
    df = load(out).set_index("x")
    assert (df.loc[list(range(20)), "status"] == "ok").all()
    assert df.loc[100, "status"] == "error" and "RuntimeError: boom at x=100" in df.loc[100, "error"]
    assert df.loc[300, "status"] == "error" and "y: 'not a float' does not fit type double" in df.loc[300, "error"]
    assert df.loc[200, "status"] == "crashed" and "worker process died" in df.loc[200, "error"]
    assert df.loc[[100, 200, 300], "y"].isna().all()
    # ok rows next to the crash kept their numbers
    assert df.loc[5, "y"] == _run({"x": 5, "scale": 1.0, "mode": "ok"})["y"]
    # a resume without --retry-errors runs nothing
    assert run_sweep(grid, out, jobs=1, quiet=True).ran == 0


@pytest.mark.subprocess
def test_retry_errors_reruns_failed_runs_and_never_warms_up_on_a_crasher(tmp_path, test_study):
    out = tmp_path / "re"
    spec = {"study": "sweeptest", "fixed": {"scale": 1.0}, "axes": {"x": [1, 2, 3, 4, 5, 6], "mode": ["pid"]}}
    grid = grid_from_spec(spec)
    assert run_sweep(grid, out, jobs=1, quiet=True).ok
    # pretend runs 0 and 1 failed earlier: 0 raised, 1 killed its worker
    store = ResultsDir(out)
    table = load(out).set_index("run_id").loc[[grid.runs[0].run_id, grid.runs[1].run_id]].reset_index()
    table["status"] = ["error", "crashed"]
    store.write_part(pa.Table.from_pandas(table, schema=store_schema(), preserve_index=False))
    assert run_sweep(grid, out, jobs=1, quiet=True).counts == {"ok": 4, "error": 1, "crashed": 1, "timeout": 0}
    report = run_sweep(grid, out, jobs=2, quiet=True, retry_errors=True)
    assert report.ran == 2 and report.ok
    df = load(out).set_index("run_id")
    here = float(os.getpid())
    assert df.loc[grid.runs[0].run_id, "y"] == here  # warm-up runs in this process ...
    assert df.loc[grid.runs[1].run_id, "y"] != here  # ... but never a run that has crashed


@pytest.mark.subprocess
def test_dask_worker_crash_is_recorded_and_never_hangs(tmp_path, test_study):
    spec = {
        "study": "sweeptest",
        "fixed": {"scale": 1.0},
        "union": [{"axes": {"x": list(range(8)), "mode": ["ok"]}}, {"axes": {"x": [200], "mode": ["crash"]}}],
    }
    # a LocalCluster that kvfast starts and stops itself
    report = run_sweep(grid_from_spec(spec), tmp_path / "d", jobs=2, backend="dask", quiet=True, stall_s=60)
    assert report.counts == {"ok": 8, "error": 0, "crashed": 1, "timeout": 0} and not report.lost
    for _, row in load(tmp_path / "d").iterrows():
        if row["status"] == "ok":
            assert row["y"] == _run({"x": int(row["x"]), "scale": 1.0, "mode": "ok"})["y"]


def test_dask_stall_stops_and_names_the_lost_runs(tmp_path, test_study):
    import logging

    from distributed import LocalCluster

    grid = grid_from_spec(test_spec(range(3), scale=[1.0]))
    with LocalCluster(n_workers=0, dashboard_address=None, silence_logs=logging.ERROR) as empty:
        t0 = time.monotonic()
        report = run_sweep(grid, tmp_path / "s", jobs=2, backend="dask", scheduler=empty.scheduler_address,
                           quiet=True, stall_s=1.0)  # fmt: skip
        assert time.monotonic() - t0 < 30
    # the warm-up run ran here; the two others never started: lost, named, not stored
    assert sorted(report.lost) == sorted(r.run_id for r in grid.runs[1:])
    assert not report.ok and "LOST 2 runs" in report.line()
    assert list(load(tmp_path / "s")["run_id"]) == [grid.runs[0].run_id]
    # the next sweep runs them
    assert run_sweep(grid, tmp_path / "s", jobs=1, quiet=True).ran == 2


@pytest.mark.subprocess
def test_a_run_that_killed_the_parent_during_warmup_goes_to_a_worker(tmp_path, test_study):
    out = tmp_path / "w"
    grid = grid_from_spec({"study": "sweeptest", "fixed": {"scale": 1.0}, "axes": {"x": [1, 2, 3], "mode": ["pid"]}})
    out.mkdir()
    (out / ".warmup").write_text(grid.runs[0].run_id)  # an earlier sweep died warming up on this run
    assert run_sweep(grid, out, jobs=2, quiet=True).ok
    df = load(out).set_index("run_id")
    assert df.loc[grid.runs[0].run_id, "y"] != float(os.getpid())
    assert df.loc[grid.runs[1].run_id, "y"] == float(os.getpid())
    assert not (out / ".warmup").exists()


def test_latest_row_wins_and_load_sorts_by_run_id(tmp_path, test_study):
    out = tmp_path / "l"
    grid = grid_from_spec(test_spec(range(3), scale=[1.0]))
    run_sweep(grid, out, jobs=1, quiet=True)
    store = ResultsDir(out)
    table = pq.read_table(store.parts()[0])
    newer = table.slice(0, 1).set_column(table.schema.get_field_index("y"), "y", pa.array([42.0]))
    store.write_part(newer)
    df = load(out)
    assert len(df) == 3 and list(df["run_id"]) == sorted(df["run_id"])
    assert df.loc[df["run_id"] == newer["run_id"][0].as_py(), "y"].item() == 42.0


def test_lock_refuses_a_second_sweep_and_leaves_results_alone(tmp_path, test_study):
    out = tmp_path / "k"
    grid = grid_from_spec(test_spec(range(2)))
    run_sweep(grid, out, jobs=1, quiet=True)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with ResultsDir(out).locked():
        with pytest.raises(ValueError, match="in use by another sweep"):
            run_sweep(grid, out, jobs=1, quiet=True, fresh=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert run_sweep(grid, out, jobs=1, quiet=True).ok  # released


@pytest.mark.parametrize(
    "ran, wall_s, printed",
    [(39, 79.7, "0.49 runs/s"), (35, 10.0, "3.5 runs/s"), (12, 1.0, "12 runs/s"), (9_001, 78.6, "115 runs/s"),
     (123_456, 10.0, "12,346 runs/s"), (0, 3.0, "0 runs/s")],
)  # fmt: skip
def test_throughput_is_printed_with_the_precision_it_has(tmp_path, ran, wall_s, printed):
    """Issue 29: "39 runs ... in 79.7 s (0 runs/s ...)": a rate under 1 was rounded to 0."""
    from kvfast.sweep import SweepReport

    line = SweepReport("s", tmp_path, total=ran, skipped=0, ran=ran, wall_s=wall_s, workers=2).line()
    assert f"({printed}, 2 workers)" in line, line
