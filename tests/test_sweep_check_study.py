"""The built-in ``check`` study: a model factory's arguments and the checker's options swept through
kvfast.check, one row per check; users' factories through ``check_study``."""

from __future__ import annotations

import pyarrow as pa
import pytest

from kvfast.cli import main
from kvfast.studies.check import STUDY, check_study, kvfast_model
from kvfast.sweep import grid_from_spec, load, load_grid, run_sweep

BASE = {
    "factory": "kvfast.studies.check:kvfast_model",
    "n_head": 2,
    "d_model": 16,
    "d_ff": 32,
    "vocab": 32,
    "order": "sequential",
    "attention": "standard",
    "prompt_seed": 0,
    "prompt_len": 5,
    "steps": 6,
    "scenarios": "both",
    "seed": 0,
    "n_layer": 2,
    "preset": "f32",
}


def test_the_builtin_check_grid_catches_the_bugs_and_passes_clean_models(tmp_path):
    grid = load_grid("check")
    assert grid.study is STUDY and len(grid) == 96
    spec = {"study": "check", "fixed": dict(BASE), "axes": {"bug": ["none", "posfrozen"], "mode": ["exact", "control"]}}
    out = tmp_path / "c"
    assert run_sweep(grid_from_spec(spec), out, jobs=1, quiet=True).ok
    df = load(out).set_index(["bug", "mode"])
    assert df.loc[("none", "exact"), "verdict"] == "exact" and df.loc[("none", "exact"), "worst_deviation"] == 0.0
    assert bool(df.loc[("none", "exact"), "passed"]) and df.loc[("none", "exact"), "first_divergent_step"] == -1
    assert df.loc[("posfrozen", "exact"), "verdict"] == "divergent" and not bool(
        df.loc[("posfrozen", "exact"), "passed"]
    )
    assert df.loc[("posfrozen", "exact"), "first_divergent_step"] >= 1
    assert df.loc[("posfrozen", "control"), "verdict"] == "bug" and df.loc[("posfrozen", "control"), "ratio"] > 1
    assert df.loc[("posfrozen", "exact"), "worst_deviation"] > 0
    # the row is the checker's own report on the factory's model
    from kvfast.check import check_cache

    config = dict(BASE, bug="posfrozen", mode="exact")
    model = kvfast_model(**{k: config[k] for k in ("seed", "n_layer", "n_head", "d_model", "d_ff", "vocab")},
                         preset="f32", order="sequential", attention="standard", bug="posfrozen")  # fmt: skip
    import numpy as np

    prompt = np.random.default_rng([0, 5, 11]).integers(0, 32, size=5)
    report = check_cache(model, prompt, 6, scenarios=("decode", "resume"))
    assert report.first_divergent_step == df.loc[("posfrozen", "exact"), "first_divergent_step"]


def test_users_factories_through_check_study(tmp_path, monkeypatch):
    import sys

    study = check_study("tinycheck", {})  # examples/tiny_model.py's factories take no arguments
    module = type(sys)("tinycheck_study")
    module.STUDY = study
    monkeypatch.setitem(sys.modules, "tinycheck_study", module)
    spec = {
        "study": "tinycheck_study:STUDY",
        "fixed": {"prompt_seed": 1, "prompt_len": 3, "steps": 8, "mode": "exact", "scenarios": "decode"},
        "axes": {"factory": ["examples.tiny_model:clean", "examples.tiny_model:posfrozen"]},
    }
    out = tmp_path / "t"
    report = run_sweep(grid_from_spec(spec), out, jobs=1, quiet=True)
    assert report.ok
    df = load(out).set_index("factory")
    assert df.loc["examples.tiny_model:clean", "verdict"] == "exact"
    assert df.loc["examples.tiny_model:posfrozen", "verdict"] == "divergent"
    # a factory that raises for some arguments is an error row, not a crash of the sweep
    bad = check_study("argcheck", {"width": pa.int64()})
    module.STUDY = bad
    spec["fixed"]["factory"] = "kvfast.studies.check:kvfast_model"  # does not take 'width'
    del spec["axes"]["factory"]
    spec["axes"]["width"] = [1, 2]
    report = run_sweep(grid_from_spec(spec), tmp_path / "e", jobs=1, quiet=True)
    assert report.counts["error"] == 2
    assert load(tmp_path / "e")["error"].str.contains("TypeError").all()


def test_an_unimportable_factory_is_refused_before_any_run(tmp_path, capsys):
    toml = tmp_path / "g.toml"
    fixed = dict(BASE, factory="no_such_pkg_xyz:make", bug="none", mode="exact")
    toml.write_text(
        'study = "check"\n[fixed]\n' + "".join(f"{k} = {v!r}\n".replace("'", '"') for k, v in fixed.items())
    )
    assert main(["run", str(toml), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "factory: 'no_such_pkg_xyz:make' cannot be imported" in err
    assert not (tmp_path / "o").exists()
    with pytest.raises(ValueError, match="bug: 'nobug' is not allowed"):
        grid_from_spec({"study": "check", "fixed": dict(BASE, bug="nobug", mode="exact")})
