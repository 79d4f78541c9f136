"""Users' own studies: ``study = "package.module:STUDY"`` and the ``kvfast.studies`` entry-point group,
through the real command line (the worked example in examples/), resume, and plain readers."""

from __future__ import annotations

import pandas as pd
import pytest
from shared import ROOT, kvfast

from kvfast.cli import main
from kvfast.sweep import grid, grid_from_spec, load


@pytest.mark.subprocess
def test_the_example_user_study_sweeps_resumes_and_lands_in_parquet(tmp_path):
    out = tmp_path / "sum_order"
    first = kvfast("run", "examples/sum_order.toml", "--out", str(out), "--jobs", "2", "--quiet")
    assert first.returncode == 0, first.stderr
    assert "360 runs in the grid, 0 already stored, 360 run now" in first.stdout
    again = kvfast("run", "examples/sum_order.toml", "--out", str(out), "--jobs", "2", "--quiet")
    assert again.returncode == 0 and "360 already stored, 0 run now" in again.stdout
    df = load(out)
    assert len(df) == 360 and (df["status"] == "ok").all()
    assert len(pd.read_parquet(out)) == 360
    from examples.sum_order_study import run

    row = df.iloc[7]
    config = {k: row[k] for k in ("seed", "n", "scale", "order")}
    assert row["total"] == run({**config, "seed": int(config["seed"]), "n": int(config["n"])})["total"]
    duckdb = pytest.importorskip("duckdb")
    worst = (
        duckdb.connect()
        .execute(
            f"""select "order", max(ulps) from read_parquet('{out}/*.parquet') where n = 1000 group by 1 order by 1"""
        )
        .fetchall()
    )
    assert [w[0] for w in worst] == ["pairwise", "sequential", "sorted"]
    shown = kvfast("show", str(out))
    assert shown.returncode == 0 and "median_ulps" in shown.stdout and "pairwise float32 sums" in shown.stdout


@pytest.mark.subprocess
def test_bad_study_references_are_refused_with_one_line_and_exit_2(tmp_path, capsys):
    for ref, match in [
        ("no_such_module_xyz:STUDY", "cannot be imported (ModuleNotFoundError"),
        ("examples.sum_order_study:NOPE", "has no attribute 'NOPE'; allowed: a kvfast Study object"),
        ("examples.sum_order_study:run", "is function, not allowed"),
        ("not-a-study", "is not allowed; allowed: "),
    ]:
        toml = tmp_path / "g.toml"
        toml.write_text(f'study = "{ref}"\n[axes]\nseed = [0]\n')
        assert main(["run", str(toml), "--out", str(tmp_path / "o"), "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and match in err, err
        assert not (tmp_path / "o").exists()


def test_a_study_registered_through_the_entry_point_group(monkeypatch):
    class EntryPoint:
        value = "examples.sum_order_study:STUDY"

        def load(self):
            from examples.sum_order_study import STUDY

            return STUDY

    monkeypatch.setattr(
        grid, "entry_points_of", lambda group: {"sum-order": EntryPoint()} if group == grid.ENTRY_POINT_GROUP else {}
    )
    spec = {"study": "sum-order", "fixed": {"n": 10, "scale": 1.0, "order": "pairwise"}, "axes": {"seed": [0, 1]}}
    g = grid_from_spec(spec)
    assert g.study.name == "sum_order" and len(g) == 2 and g.study_ref == "sum-order"


def test_a_run_that_raises_in_a_user_study_is_an_error_row_not_a_crash(tmp_path):
    spec = {"study": "examples.sum_order_study:STUDY", "fixed": {"scale": 1.0, "order": "pairwise", "n": 10}}
    spec["axes"] = {"seed": [0, 1]}
    g = grid_from_spec(spec)
    import dataclasses

    def boom(config):
        raise RuntimeError("user bug")

    bad = dataclasses.replace(g.study, run=boom)
    object.__setattr__(g, "study", bad)
    from kvfast.sweep import run_sweep

    report = run_sweep(g, tmp_path / "o", jobs=1, quiet=True)
    assert report.counts["error"] == 2
    assert load(tmp_path / "o")["error"].str.contains("RuntimeError: user bug").all()


def test_the_model_functions_example_in_the_docs_is_a_study_that_sweeps(tmp_path, monkeypatch):
    """docs/sweep.md, "The model functions a study calls": its study, as a user's module, swept through a grid."""
    import re

    from kvfast.sweep import run_inline

    text = (ROOT / "docs" / "sweep.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "cache_vs_recompute" in b]
    (tmp_path / "cache_study.py").write_text(block)
    monkeypatch.syspath_prepend(str(tmp_path))
    axes = {"seed": {"range": [0, 3]}, "n_layer": [1, 2], "preset": ["f64", "f32", "bf16"]}
    df = run_inline({"study": "cache_study:STUDY", "axes": axes})
    assert len(df) == 18 and (df["status"] == "ok").all()
    assert df["same_tokens"].all() and (df["max_dev"] == 0.0).all()  # kvfast's cache is exact in every preset
    for field, bad in (("preset", "f16"), ("n_layer", 0), ("seed", -1)):
        with pytest.raises(ValueError, match=rf"{field}: .* is not allowed"):
            run_inline({"study": "cache_study:STUDY", "axes": dict(axes, **{field: [bad]})})
