"""Planning and resume at scale: run ids from per-axis pieces, validation once per axis value, lazy
expansion, the --max-runs limit, stored-id lookups, and readers of the results directory."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from kvfast.studies import STUDIES
from kvfast.sweep import grid_from_spec, load, load_grid, run_id, run_sweep
from kvfast.sweep.ids import canonical
from kvfast.sweep.plan import find_pending
from kvfast.sweep.store import ResultsDir, StoredIndex
from kvfast.sweep.study import Study

CALLS: list[dict] = []


def _validate(config: dict) -> None:
    CALLS.append(dict(config))
    if config["x"] < 0:
        raise ValueError(f"x: {config['x']!r} is not allowed; allowed: an integer >= 0")
    if config["k"] % config["m"]:
        raise ValueError(f"k: {config['k']} is not allowed with m={config['m']}; allowed: a multiple of m")


def _run(config: dict) -> dict:
    return {"y": config["x"] * config["lr"] + config["k"]}


PIECES = Study(
    name="pieces",
    version="3",
    description="test-only study with every column kind",
    run=_run,
    config_fields={
        "x": pa.int64(),
        "lr": pa.float64(),
        "k": pa.int64(),
        "m": pa.int64(),
        "name": pa.string(),
        "flag": pa.bool_(),
        "xs": pa.list_(pa.float64()),
    },
    result_fields={"y": pa.float64()},
    validate_config=_validate,
    summarize=lambda df: df.head(0),
    validate_groups=(("k", "m"),),
)


@pytest.fixture
def pieces(monkeypatch):
    monkeypatch.setitem(STUDIES, "pieces", PIECES)
    CALLS.clear()
    return PIECES


def spec(**axes) -> dict:
    base = {
        "study": "pieces",
        "fixed": {"name": 'quote " and {brace}', "xs": [1, 0.1]},
        "axes": {"x": [0, 1, 2], "lr": [1, 0.1, 1e-300, 2.5], "flag": [True, False]},
        "tied": [{"k": [4, 6, 9], "m": [2, 3, 3]}],
        "union": [{}, {"fixed": {"flag": True}, "axes": {"x": [2, 3]}}],
    }
    base["axes"].update(axes)
    return base


def test_run_ids_from_pieces_equal_the_canonical_json_ids(pieces):
    grid = grid_from_spec(spec())
    runs = grid.runs
    # entry 0: 3 x 4 x 2 x 3 = 72; entry 1: 2 x 4 x 3 = 24, of which x=2, flag=True (12) repeat entry 0
    assert len(grid) == len(runs) == 72 + 12
    for run in runs:
        assert run.run_id == run_id("pieces", "3", run.config)
        assert list(run.config) == list(PIECES.config_fields)
    assert [r.run_id for r in runs] == list(grid.iter_ids())
    assert len({r.run_id for r in runs}) == len(runs)
    # integers in float columns became floats, also inside lists
    assert runs[0].config["lr"] == 1.0 and isinstance(runs[0].config["lr"], float)
    assert runs[0].config["xs"] == [1.0, 0.1] and isinstance(runs[0].config["xs"][0], float)


def test_expansion_order_and_first_position_deduplication_match_a_plain_product(pieces):
    s = spec(x=[1, 0, 1, 2], lr=[0.5, 1, 1.0])  # repeated axis values, and 1 == 1.0 in a float column
    grid = grid_from_spec(s)
    naive = []
    for entry in s["union"]:
        top = {**s["fixed"], **entry.get("fixed", {})}
        axes = {
            k: v for k, v in s["axes"].items() if k not in entry.get("fixed", {}) and k not in entry.get("axes", {})
        }
        axes.update(entry.get("axes", {}))
        tied = list(zip(*s["tied"][0].values(), strict=True))
        for combo in itertools.product(*axes.values(), tied):
            config = dict(top, **dict(zip(axes, combo[:-1], strict=True)), k=combo[-1][0], m=combo[-1][1])
            config = {f: config[f] for f in PIECES.config_fields}
            config["lr"] = float(config["lr"])
            config["xs"] = [float(v) for v in config["xs"]]
            naive.append((run_id("pieces", "3", config), config))
    first = list(dict(naive).items())  # first occurrence of each id, in product order
    seen, expected = set(), []
    for rid, config in naive:
        if rid not in seen:
            seen.add(rid)
            expected.append((rid, config))
    assert [(r.run_id, r.config) for r in grid.runs] == expected
    assert len(first) == len(expected)


def test_validation_runs_once_per_axis_value_not_once_per_run(pieces):
    s = spec(x=list(range(500)))
    grid = grid_from_spec(s)
    assert len(grid) > 4000
    # one reference config per union entry, then each distinct value of each group once
    assert len(CALLS) < 500 + 4 + 2 + 3 + 2 + 10
    s["axes"]["x"] = list(range(499)) + [-1]
    with pytest.raises(ValueError, match=r"x: -1 is not allowed; allowed: an integer >= 0"):
        grid_from_spec(s)
    s["axes"]["x"] = [0]
    s["tied"][0]["m"] = [2, 4, 3]  # 6 % 4: a cross-field check of one validation group
    with pytest.raises(ValueError, match=r"k: 6 is not allowed with m=4"):
        grid_from_spec(s)


def test_a_huge_grid_is_refused_before_expansion_and_a_large_one_is_lazy(pieces):
    huge = spec(x=list(range(10**6)), lr=list(range(10**4)))
    with pytest.raises(ValueError, match=r"runs is not allowed; allowed: at most 10,000,000 runs"):
        grid_from_spec(huge)
    big = spec(x=list(range(10**4)), lr=list(range(10**4)))
    big["union"][1]["fixed"]["name"] = "another"  # no run of one entry can equal one of the other
    grid = grid_from_spec(big, max_runs=10**9)
    assert len(grid) == 10**4 * 10**4 * 2 * 3 + 2 * 10**4 * 3  # counted, not expanded
    first = next(grid.iter_runs())
    assert first.run_id == run_id("pieces", "3", first.config)
    with pytest.raises(ValueError, match=r"--max-runs: 0 is not allowed"):
        grid_from_spec(spec(), max_runs=0)


def test_stored_index_lookup_is_exact_even_when_ids_share_their_first_64_bits():
    ids = np.array([b"0" * 16 + b"a" * 16, b"0" * 16 + b"b" * 16, b"f" * 32, b"1" * 32], dtype="S32")
    index = StoredIndex.build(ids, np.array([0, 1, 2, 0], np.int8))
    got = index.lookup(["0" * 16 + "b" * 16, "0" * 16 + "a" * 16, "0" * 16 + "c" * 16, "f" * 32, "e" * 32])
    assert got.tolist() == [1, 0, -1, 2, -1]
    assert index.ids_with(0) == {"0" * 16 + "a" * 16, "1" * 32}


def test_resume_runs_exactly_the_missing_runs_in_grid_order(tmp_path, pieces):
    full = grid_from_spec(spec())
    part = grid_from_spec(spec(x=[0, 2]))
    out = tmp_path / "r"
    assert run_sweep(part, out, jobs=1, quiet=True).ok
    stored = ResultsDir(out).stored_index()
    plan = find_pending(full, stored, ())
    stored_ids = set(load(out)["run_id"])
    expected = [r.run_id for r in full.runs if r.run_id not in stored_ids]
    assert plan.total == len(expected) and plan.skipped_counts == {"ok": len(stored_ids)}
    report = run_sweep(full, out, jobs=1, quiet=True, chunk_size=5)
    assert report.ran == len(expected) and report.skipped == len(stored_ids) and report.ok
    df = load(out)
    assert set(df["run_id"]) == {r.run_id for r in full.runs}
    for run in full.runs[:5]:
        assert df.set_index("run_id").loc[run.run_id, "y"] == _run(run.config)["y"]


def test_pyarrow_dataset_and_duckdb_read_the_results_directory(tmp_path):
    duckdb = pytest.importorskip("duckdb")
    grid = load_grid("invariance")
    out = tmp_path / "inv"
    assert run_sweep(grid, out, jobs=1, quiet=True).ok
    df = load(out)
    table = ds.dataset(out, format="parquet").to_table()
    assert table.num_rows == len(grid) and sorted(table.column("run_id").to_pylist()) == list(df["run_id"])
    con = duckdb.connect()
    n, ok = con.execute(f"select count(*), sum((status = 'ok')::int) from read_parquet('{out}/*.parquet')").fetchone()
    assert (n, ok) == (len(grid), len(grid))
    got = con.execute(f"select run_id, seed from read_parquet('{out}/*.parquet') order by run_id").df()
    assert list(got["run_id"]) == list(df["run_id"]) and list(got["seed"]) == list(df["seed"])


def test_canonical_spec_and_dataclass_study_still_work(pieces):
    other = dataclasses.replace(PIECES, validate_groups=None)  # no groups: every run validated
    STUDIES["pieces"] = other
    CALLS.clear()
    grid = grid_from_spec(spec())
    assert len(CALLS) == len(grid) and grid.spec == canonical(spec())
