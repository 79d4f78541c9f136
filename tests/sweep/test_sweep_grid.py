"""Grids and run ids: expansion, sizes, validation before any run, id stability."""

from __future__ import annotations

import importlib.util
import re

import numpy as np
import pyarrow as pa
import pytest
from shared import ROOT

from kvfast.studies import STUDIES
from kvfast.sweep import builtin_grids, grid_from_configs, grid_from_spec, load_grid, run_id, schema_for
from kvfast.sweep.ids import canonical_json

EXACT_FIXED = {"vocab": 32, "d_model": 16, "d_ff": 32}


def exact_spec(**axes) -> dict:
    base = {
        "seed": [0],
        "n_layer": [1],
        "n_head": [1],
        "prompt_len": [3],
        "steps": [4],
        "order": ["sequential"],
        "preset": ["f64"],
    }
    base.update(axes)
    return {"study": "exactness", "fixed": dict(EXACT_FIXED), "axes": base}


def test_exactness_grid_is_1296_runs_of_432_configs_times_3_presets():
    grid = load_grid("exactness")
    assert len(grid) == 1296
    assert len({r.run_id for r in grid.runs}) == 1296
    presets = {}
    for r in grid.runs:
        presets.setdefault(r.config["preset"], set()).add(
            tuple(sorted((k, v) for k, v in r.config.items() if k != "preset"))
        )
    assert sorted(presets) == ["bf16", "f32", "f64"]
    assert all(len(v) == 432 for v in presets.values())
    assert presets["f64"] == presets["f32"] == presets["bf16"]


def test_every_builtin_grid_expands_and_validates():
    grids = builtin_grids()
    assert "exactness" in grids
    has_hf = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
    for name in grids:
        if name.startswith("hf_") and not has_hf:  # the Hugging Face studies need kvfast[hf]: refused in one line
            with pytest.raises(ValueError, match=rf"study {name}: needs .*install kvfast\[hf\]"):
                load_grid(name)
            continue
        if name == "engines_all" and importlib.util.find_spec("llama_cpp") is None:
            # llama.cpp is a source build kept out of CI: the grid that names it is refused in one line
            with pytest.raises(ValueError, match=r"engines_all: engine: 'llamacpp' needs llama_cpp"):
                load_grid(name)
            continue
        grid = load_grid(name)
        assert len(grid) > 0
        assert grid.study.name in STUDIES
        for r in grid.runs[:50]:
            assert list(r.config) == list(grid.study.config_fields)


def test_engine_grid_without_its_engine_is_refused_before_any_run(monkeypatch):
    # the path CI takes (no llama_cpp), forced here so it is tested where llama_cpp is installed too
    import kvfast.studies.engines as engines

    real = importlib.util.find_spec
    monkeypatch.setattr(engines.importlib.util, "find_spec", lambda n, *a: None if n == "llama_cpp" else real(n, *a))
    with pytest.raises(ValueError, match=r"engines_all: engine: 'llamacpp' needs llama_cpp and torch; allowed: "):
        load_grid("engines_all")


def test_cartesian_tied_and_union_sizes_and_order():
    spec = exact_spec(seed=[0, 1, 2], preset=["f64", "f32"])
    assert len(grid_from_spec(spec)) == 6
    first = grid_from_spec(spec).runs
    assert [(r.config["seed"], r.config["preset"]) for r in first[:3]] == [(0, "f64"), (0, "f32"), (1, "f64")]

    tied = exact_spec(seed=[0, 1, 2])
    del tied["axes"]["n_layer"], tied["axes"]["n_head"]
    tied["tied"] = [{"n_layer": [1, 2, 3], "n_head": [1, 2, 4]}]
    g = grid_from_spec(tied)
    assert len(g) == 9
    assert {(r.config["n_layer"], r.config["n_head"]) for r in g.runs} == {(1, 1), (2, 2), (3, 4)}

    union = exact_spec(seed=[0, 1])
    union["union"] = [{"axes": {"steps": [4, 8]}}, {"fixed": {"steps": 16}, "axes": {"preset": ["bf16", "f32"]}}]
    g = grid_from_spec(union)
    # 2 seeds x 2 steps, plus 2 seeds x 2 presets at steps 16
    assert len(g) == 8
    assert sorted({r.config["steps"] for r in g.runs}) == [4, 8, 16]
    assert {r.config["preset"] for r in g.runs if r.config["steps"] == 16} == {"bf16", "f32"}

    # duplicates across union entries are kept once
    dup = exact_spec(seed=[0, 1])
    dup["union"] = [{}, {"axes": {"seed": [1, 2]}}]
    assert len(grid_from_spec(dup)) == 3


def test_run_id_is_stable_across_numpy_scalars_key_order_and_int_in_float():
    a = {"x": 0.1, "n": 3, "s": "f64", "flag": True, "xs": [1.5, 2.0]}
    b = {"xs": np.array([1.5, 2.0]), "flag": np.bool_(True), "s": "f64", "n": np.int64(3), "x": np.float64(0.1)}
    assert run_id("st", "1", a) == run_id("st", "1", b)
    assert canonical_json(a) == canonical_json(b)
    # distinct values, versions and studies give distinct ids
    assert run_id("st", "1", a) != run_id("st", "1", dict(a, x=np.float32(0.1)))
    assert run_id("st", "1", a) != run_id("st", "1", dict(a, x=0.1 + 2**-56))
    assert run_id("st", "1", a) != run_id("st", "1", dict(a, flag=1))
    assert run_id("st", "1", a) != run_id("st", "2", a)
    assert run_id("st", "1", a) != run_id("other", "1", a)
    # a fixed, known value: the id must not drift between kvfast versions or machines
    assert run_id("exactness", "1", {"seed": 0}) == run_id("exactness", "1", {"seed": np.int32(0)})
    assert len(run_id("st", "1", a)) == 32
    with pytest.raises(ValueError, match="not allowed"):
        canonical_json({"x": object()})


def test_run_id_of_a_grid_run_does_not_depend_on_how_the_grid_is_written():
    g1 = grid_from_spec(exact_spec(seed=[0, 1], steps=[4]))
    spec = exact_spec(steps=[4])
    spec["fixed"]["seed"] = 1
    del spec["axes"]["seed"]
    g2 = grid_from_spec(spec)
    assert g2.runs[0].run_id == g1.runs[1].run_id


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda s: s["axes"].update(colour=["red"]), "axis 'colour' is not a config field of study 'exactness'"),
        (lambda s: s["axes"].update(order=["reverse"]), "order: 'reverse' is not allowed; allowed: sequential"),
        (lambda s: s["axes"].update(n_layer=[0]), "n_layer: 0 is not allowed; allowed: an integer >= 1"),
        (lambda s: s["axes"].update(preset=["f16"]), "preset: 'f16' is not allowed; allowed: f64, f32, bf16"),
        (lambda s: s["axes"].update(seed=[]), "axes.seed: \\[\\] is empty"),
        (lambda s: s["axes"].update(seed=3), "axes.seed: 3 is not an array"),
        (lambda s: s["fixed"].pop("vocab"), "vocab: missing from the grid"),
        (lambda s: s.update(study="nope"), "study: 'nope' is not allowed; allowed: .*exactness"),
        (lambda s: s.update(colour=1), "key 'colour' is not allowed; allowed: study, description"),
        (lambda s: s["fixed"].update(seed=1), "key 'seed' is set twice"),
        (lambda s: s.update(tied=[{"n_layer": [1, 2], "n_head": [1]}]), "arrays have different lengths"),
        (lambda s: s["axes"].update(n_head=["2"]), "n_head: '2' is not allowed"),
        (lambda s: s["axes"].update(seed={"range": [5, 5]}), r"axes.seed: \{'range': \[5, 5\]\} is empty"),
        (lambda s: s["axes"].update(seed={"range": [5, 0]}), r"axes.seed: \{'range': \[5, 0\]\} is empty"),
        (lambda s: s.update(tied=[{"n_layer": {"range": [1, 1]}, "n_head": [1]}]), r"tied\[0\].n_layer: .* is empty"),
    ],
)
def test_bad_grids_are_refused_naming_field_value_and_allowed(mutate, match):
    spec = exact_spec()
    if "tied" in match or "different lengths" in match:
        del spec["axes"]["n_layer"], spec["axes"]["n_head"]
    mutate(spec)
    with pytest.raises(ValueError, match=match):
        grid_from_spec(spec)


def test_a_range_is_the_array_of_integers_it_names(tmp_path):
    """``{range = [START, STOP(, STEP)]}`` gives the runs, ids and order of the array Python's ``range`` makes, as
    an axis, in a tied group and in a union entry; read from TOML text."""
    path = tmp_path / "r.toml"
    head = 'study = "exactness"\n[fixed]\nvocab = 32\nd_model = 16\nd_ff = 32\nprompt_len = 3\norder = "sequential"\n'
    path.write_text(
        head + 'preset = "f64"\n[axes]\nseed = {range = [0, 100]}\nn_layer = {range = [3, 0, -2]}\n'
        "[[tied]]\nn_head = {range = [1, 3]}\nsteps = [4, 8]\n"
    )
    listed = tmp_path / "l.toml"
    listed.write_text(
        head + 'preset = "f64"\n[axes]\nseed = ' + str(list(range(100))) + "\nn_layer = [3, 1]\n"
        "[[tied]]\nn_head = [1, 2]\nsteps = [4, 8]\n"
    )
    ranged, written = load_grid(str(path)), load_grid(str(listed))
    assert len(ranged) == 100 * 2 * 2
    assert ranged.runs == written.runs
    # a control: another range is another grid
    path.write_text(path.read_text().replace("[0, 100]", "[0, 100, 5]"))
    stepped = load_grid(str(path))
    assert [r.config["seed"] for r in stepped.runs[::4]] == list(range(0, 100, 5))
    assert len(stepped) == 20 * 2 * 2 and stepped.runs != written.runs
    union = exact_spec()
    union["union"] = [{"axes": {"seed": {"range": [0, 3]}}}, {"axes": {"seed": {"range": [2, 5]}}}]
    assert [r.config["seed"] for r in grid_from_spec(union).runs] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "bad",
    [
        {"range": [0, 9, 0]},
        {"range": [0.0, 9]},
        {"range": [True, 9]},
        {"range": [9]},
        {"range": [0, 9, 1, 1]},
        {"range": [0, 9], "step": 2},
        {"range": "0..9"},
        {"start": 0, "stop": 9},
    ],
)
def test_a_range_of_another_form_is_refused_naming_the_axis_and_the_form(bad):
    form = r"allowed: an array of values, or \{range = \[START, STOP\]\} or \{range = \[START, STOP, STEP\]\}"
    with pytest.raises(ValueError, match=rf"^<grid>: axes.seed: {re.escape(repr(bad))} is not allowed; {form}"):
        grid_from_spec(exact_spec(seed=bad))
    assert len(grid_from_spec(exact_spec(seed={"range": [0, 9, 2]}))) == 5  # a control: the form allowed


def test_a_range_longer_than_the_run_limit_is_refused_before_it_is_expanded():
    spec = exact_spec(seed={"range": [0, 10**15]})
    with pytest.raises(ValueError, match=r"axes.seed: .* is 1,000,000,000,000,000 values; allowed: at most 10,000,000"):
        grid_from_spec(spec)  # expanded, this range would not fit in memory: refused at once
    assert len(grid_from_spec(exact_spec(seed={"range": [0, 5]}), max_runs=5)) == 5  # a control: at the limit
    with pytest.raises(ValueError, match=r"axes.seed: .* is 6 values; allowed: at most 5, the most runs"):
        grid_from_spec(exact_spec(seed={"range": [0, 6]}), max_runs=5)


def test_toml_errors_and_unknown_grid(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('study = "exactness"\n[axes\nseed = [0]\n')
    with pytest.raises(ValueError, match="TOML syntax error"):
        load_grid(str(bad))
    with pytest.raises(ValueError, match="not a built-in grid; allowed: .*exactness"):
        load_grid("no-such-grid")
    with pytest.raises(ValueError, match="is not a file"):
        load_grid(str(tmp_path / "missing.toml"))


def test_schema_is_explicit():
    study = STUDIES["exactness"]
    schema = schema_for(study)
    assert schema.names[0] == "run_id"
    assert schema.names[-3:] == ["status", "error", "wall_s"]
    for name in ("seed", "n_layer", "n_head", "prompt_len", "steps", "order", "preset"):
        assert name in schema.names
    for name in ("storage", "accum", "max_abs_dev", "first_bad_step", "tokens_equal"):
        assert name in schema.names
    assert schema.field("max_abs_dev").type == pa.float64()
    assert schema.field("wall_s").type == pa.float64()


def test_the_toml_examples_in_docs_are_valid_grids():
    import tomllib

    text = (ROOT / "docs" / "sweep.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", text, flags=re.S)
    sizes = [len(grid_from_spec(tomllib.loads(b))) for b in blocks]
    assert sizes == [10 * 2 * 2 * 3, 432, 2 * 2 + 2 * 3]  # the quick start, the full form, the union


def test_configs_go_through_the_same_pipeline_as_a_toml_grid():
    """A list of configs gives the TOML grid's runs: same run ids, same normalised configs, same order."""
    grid = load_grid("invariance")
    again = grid_from_configs("invariance", grid.configs)
    assert again.runs == grid.runs
    assert grid_from_configs("invariance", grid.configs * 2).runs == grid.runs  # a repeated config runs once
    bad = dict(grid.configs[0], prompt_len=0)
    with pytest.raises(ValueError, match="prompt_len: 0 is not allowed"):
        grid_from_configs("invariance", [bad])
    with pytest.raises(ValueError, match="configs: empty"):
        grid_from_configs("invariance", [])
    with pytest.raises(ValueError, match=r"configs\[0\]: list is not allowed"):
        grid_from_configs("invariance", [[1, 2]])


def test_run_inline_takes_a_spec_and_refuses_configs_without_a_study():
    from kvfast.sweep import run_inline

    spec = {"study": "invariance", "fixed": dict(load_grid("invariance").configs[0])}
    df = run_inline(spec)
    assert list(df["run_id"]) == [load_grid("invariance").runs[0].run_id] and list(df["status"]) == ["ok"]
    with pytest.raises(ValueError, match="study: None is not allowed"):
        run_inline([spec["fixed"]])
