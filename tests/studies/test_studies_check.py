"""The built-in ``check`` study: a model factory's arguments and the checker's options swept through
kvfast.check, one row per check; users' factories through ``check_study``."""

from __future__ import annotations

import pyarrow as pa
import pytest

from kvfast.check.check_report import PASSING
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
    "promote": "none",
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
        "fixed": {
            "prompt_seed": 1,
            "prompt_len": 3,
            "steps": 8,
            "mode": "exact",
            "scenarios": "decode",
            "promote": "none",
        },
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


@pytest.mark.subprocess
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


def test_a_row_says_where_the_check_failed_and_the_native_verdict_beside_the_logic_checks():
    """A bfloat16 Llama with the ``posoff`` bug: its own format sees rounding, the float64 logic check a bug at decode
    step 1; the row's verdict is the deciding one, both stand beside it, and the failure is the logic check's."""
    torch = pytest.importorskip("torch")
    from kvfast.bugs.hf import inject_hf_bug
    from kvfast.check.hf import HFModel
    from kvfast.studies.check import check_one
    from kvfast.testing import tiny_model

    torch.set_num_threads(1)
    config = {"prompt_seed": 0, "prompt_len": 6, "steps": 8, "mode": "auto", "scenarios": "both"}
    model = lambda bug: inject_hf_bug(HFModel(tiny_model("llama", "bfloat16")), bug)  # noqa: E731
    rows = {
        (bug, promote): check_one(model(bug), {**config, "promote": promote})
        for bug in (None, "posoff") for promote in ("none", "float64")
    }  # fmt: skip
    found = rows[("posoff", "float64")]
    assert (found["verdict"], found["native_verdict"], found["logic_verdict"]) == ("bug", "rounding", "bug")
    assert not found["passed"] and (found["failed_scenario"], found["failed_step"]) == ("decode", 1)
    native = rows[("posoff", "none")]  # the control: without the logic check the bug hides below bfloat16's digits
    assert (native["verdict"], native["native_verdict"], native["logic_verdict"]) == ("rounding", "rounding", None)
    assert native["passed"] and (native["failed_scenario"], native["failed_step"]) == ("", -1)
    clean = rows[(None, "float64")]
    assert clean["passed"] and clean["native_verdict"] == clean["verdict"] and clean["logic_verdict"] in PASSING


def test_the_builtin_claims_are_about_the_builtin_factory_only():
    """``kvfast show`` of a user's factory swept through the built-in study prints no claim about kvfast's model
    (it read "0 of 0 bugged exact checks fail ... False"); the same rows under the built-in factory do."""
    import pandas as pd

    rows = [dict(BASE, bug=bug, mode="exact", status="ok", passed=bug == "none") for bug in ("none", "posfrozen")]
    own = pd.DataFrame(rows)
    assert [c.holds for c in STUDY.claims(own)] == [True]
    assert STUDY.claims(own.assign(factory="mypkg.models:make")) == []
