"""The bug catalogues (kvfast.bugs): one shape for every bug, each injected by subclassing an adapter's hooks, each
first acting where its entry says; and the product adapters hold no bug branch."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest

import kvfast
from kvfast.bugs import CATALOGUES, HF_BUGS, KVFAST_BUGS, LOSSY_BUGS, Bug
from kvfast.bugs.lossy import inject_lossy_bug
from kvfast.bugs.operations import inject_op_bug
from kvfast.check import KvfastModel, check_cache
from kvfast.check.lossy import LossyKvfastModel
from kvfast.model.bugs import BUGS

CFG = kvfast.ModelConfig(vocab=64, d_model=32, n_head=4, n_layer=2, d_ff=64, max_pos=64)
PROMPT = np.array([1, 2, 3, 4, 5, 6])
STEPS = 14  # > EVICT_WINDOW - len(PROMPT): evict bites


@pytest.fixture(scope="module")
def params():
    return kvfast.init_params(CFG, 0)


def test_every_catalogue_has_one_shape():
    assert list(CATALOGUES) == ["kvfast", "hf", "operations", "lossy"]
    assert [len(c) for c in CATALOGUES.values()] == [8, 6, 7, 1]
    assert list(KVFAST_BUGS) == list(BUGS) and {b: KVFAST_BUGS[b].description for b in BUGS} == BUGS
    for catalogue in CATALOGUES.values():
        for name, bug in catalogue.items():
            assert type(bug) is Bug and bug.name == name
            assert isinstance(bug.description, str) and bug.description
            assert callable(bug.acts) and callable(bug.inject)
    with pytest.raises(dataclasses.FrozenInstanceError):
        HF_BUGS["posoff"].name = "other"
    assert [b for b in HF_BUGS if not HF_BUGS[b].logic] == ["f16"]


@pytest.mark.parametrize("bug", list(KVFAST_BUGS))
def test_kvfasts_own_bugs_first_act_where_the_catalogue_says(params, bug):
    entry = KVFAST_BUGS[bug]
    model = entry.inject(KvfastModel(CFG, params))
    assert model.bug == bug and type(model) is KvfastModel
    report = check_cache(model, PROMPT, STEPS, scenarios="decode")
    assert report.scenarios["decode"].first_divergent_step == entry.first_acting_step("decode", len(PROMPT))
    with pytest.raises(ValueError, match="scenario: 'resume' is not allowed; allowed: decode"):
        entry.first_acting_step("resume", len(PROMPT))


def _first_difference(a, b, split: int | None) -> int | None:
    """The first step (0: the last prompt chunk's rows) at which two lossy models' cache paths differ."""
    rows = []
    for model in (a, b):
        if split is None:
            out = [model.prefill(PROMPT)]
        else:
            model.prefill(PROMPT[:split])
            out = [model.extend(PROMPT[split:])]
        out += [model.decode(int(t))[None] for t in range(1, 9)]
        rows.append(out)
    steps = [t for t, (x, y) in enumerate(zip(*rows, strict=True)) if not np.array_equal(x, y)]
    return steps[0] if steps else None


def test_the_lossy_bug_first_acts_where_the_catalogue_says(params):
    entry = LOSSY_BUGS["int4"]
    for scenario, split in (("decode", None), ("resume", 3)):
        clean = LossyKvfastModel(CFG, params, "f64", fmt="int8")
        bugged = inject_lossy_bug(LossyKvfastModel(CFG, params, "f64", fmt="int8"), "int4")
        assert _first_difference(clean, bugged, split) == entry.first_acting_step(scenario), scenario
    promoted = bugged.promote("float64")
    assert promoted._stored_format() == "int4" and repr(promoted).endswith("lossy_bug='int4')")
    with pytest.raises(ValueError, match="lossy_bug: 'x' is not allowed; allowed: int4"):
        inject_lossy_bug(clean, "x")


def test_a_bug_subclasses_the_adapter_in_place_and_keeps_its_name(params):
    clean = KvfastModel(CFG, params)
    model = KvfastModel(CFG, params)
    assert inject_op_bug(model, "crop_short") is model
    assert isinstance(model, KvfastModel) and type(model) is not KvfastModel
    assert type(model).__name__ == "KvfastModel"  # reports and errors name the adapter the user built
    assert type(inject_op_bug(KvfastModel(CFG, params), "crop_short")) is type(model)  # one class per bug
    assert model._crop_keep(3, 5) == 4 and clean._crop_keep(3, 5) == 3 and type(clean) is KvfastModel
    assert inject_op_bug(clean, None) is clean and type(clean) is KvfastModel
    with pytest.raises(ValueError, match="model: KvfastModel is not allowed; allowed: a LossyKvfastModel"):
        inject_lossy_bug(KvfastModel(CFG, params), "int4")
    with pytest.raises(ValueError, match="model: str is not allowed"):
        KVFAST_BUGS["stale"].inject("a model")


# --- the product holds no bug branch ----------------------------------------------------------------------------

PRODUCT_ADAPTERS = ("check/hf.py", "check/hf_path.py", "check/adapters.py", "check/lossy.py", "check/engines/ort.py",
                    "check/engines/llamacpp.py", "check/engines/transformer_lens.py")  # fmt: skip
BUG_ATTRIBUTES = {"bug", "op_bug", "lossy_bug"}


def bug_branches(source: str) -> list[str]:
    """Every comparison of a bug attribute (``self.bug``, ``op_bug``, ``getattr(x, "op_bug")``) in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            named = (
                side.attr if isinstance(side, ast.Attribute)
                else side.id if isinstance(side, ast.Name)
                else side.args[1].value
                if isinstance(side, ast.Call) and len(side.args) > 1 and isinstance(side.args[1], ast.Constant)
                else None
            )  # fmt: skip
            if named in BUG_ATTRIBUTES:
                found.append(ast.unparse(node))
    return found


def test_the_product_adapters_hold_no_bug_branch():
    root = Path(kvfast.__file__).resolve().parent
    for path in PRODUCT_ADAPTERS:
        assert bug_branches((root / path).read_text()) == [], path


def test_the_branch_finder_finds_a_branch():
    """Failing data: the branches the adapters held before the catalogue moved out."""
    before = (
        "def decode(self):\n    if self.bug == 'posoff':\n        pass\n"
        "def crop(adapter):\n    if getattr(adapter, 'op_bug', None) == 'crop_short':\n        pass\n"
    )
    assert bug_branches(before) == ["self.bug == 'posoff'", "getattr(adapter, 'op_bug', None) == 'crop_short'"]
