"""``CheckOptions``: the checker's options as one object, validated once, shared by ``check_cache``, the
``kv_check`` fixture, ``kvfast check`` and the check study; and the checker's code layout."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import numpy as np
import pytest

from kvfast import ModelConfig, init_params
from kvfast.check import CheckOptions, KvfastModel, check_cache, check_cache_with
from kvfast.check.options import DEFAULT_STEPS

CFG = ModelConfig(vocab=32, d_model=16, n_head=2, n_layer=2, d_ff=32, max_pos=48)
PROMPT = [3, 1, 4, 1, 5, 9]
ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 0)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(steps=None), "steps: None is not allowed; allowed: an integer >= 1 (or give a continuation)"),
        (dict(steps=0), "steps: 0 is not allowed"),
        (dict(steps=3, continuation=[1, 2]), "steps: 3 is not allowed"),
        (dict(continuation=[]), "continuation: shape (0,) is not allowed"),
        (dict(continuation=[1, -1]), "continuation: token -1 is out of range"),
        (dict(mode="loose"), "mode: 'loose' is not allowed"),
        (dict(scenarios=()), "scenarios: () is not allowed"),
        (dict(scenarios="warp"), "scenarios: 'warp' is not allowed"),
        (dict(scenarios=("decode", "decode")), "scenarios: 'decode' appears twice; allowed: each scenario once"),
        (dict(fast=1), "fast: 1 is not allowed; allowed: True or False"),
        (dict(keep_logits="yes"), "keep_logits: 'yes' is not allowed; allowed: True or False"),
        (dict(follow="mine"), "follow: 'mine' is not allowed; allowed: recompute, cache"),
        (dict(follow="cache", mode="control"), "follow: 'cache' is not allowed with mode='control'"),
        (dict(follow="cache", steps=2, continuation=[1, 2]), "follow: 'cache' is not allowed with a continuation"),
        (dict(promote="float16"), "promote: 'float16' is not allowed"),
        (dict(margin=0.5), "margin: 0.5 is not allowed; allowed: a finite number >= 1"),
        (dict(decisive=2.0), "decisive: 2.0 is not allowed; allowed: a finite number >= 4"),
        (dict(timeout=-1), "timeout: -1 is not allowed; allowed: None or a number of seconds > 0"),
    ],
)
def test_each_bad_field_is_a_value_error_naming_it(fields, message):
    fields = {"steps": 4, **fields}
    with pytest.raises(ValueError) as exc:
        CheckOptions(**fields)
    assert message in str(exc.value)


def test_options_are_normalized_and_frozen():
    options = CheckOptions(continuation=np.array([5, 6, 7]), scenarios="resume", margin=2, decisive=8)
    assert options.steps == 3 and options.continuation == (5, 6, 7) and options.scenarios == ("resume",)
    assert isinstance(options.margin, float) and isinstance(options.decisive, float)
    assert CheckOptions(2, continuation=[5, 6, 7]).continuation == (5, 6)
    assert options.given_tokens().dtype == np.int64
    assert hash(options) == hash(dataclasses.replace(options))
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.mode = "control"  # type: ignore[misc]
    assert CheckOptions.defaulting_steps().steps == DEFAULT_STEPS == 64
    assert CheckOptions.defaulting_steps(continuation=[1, 2]).steps == 2


def test_check_cache_with_options_is_check_cache(params):
    model = KvfastModel(CFG, params, "f32", bug="posfrozen")
    fields = dict(steps=8, mode="control", scenarios=("resume", "decode"), split=2, keep_logits=True)
    a = check_cache(model, PROMPT, **fields)
    b = check_cache_with(model, PROMPT, CheckOptions(**fields))
    assert a.format() == b.format() and a.verdict == b.verdict == "bug"
    for name in a.scenarios:
        assert np.array_equal(a.scenarios[name].ratio, b.scenarios[name].ratio)
        assert np.array_equal(a.scenarios[name].cache_logits, b.scenarios[name].cache_logits)
    with pytest.raises(ValueError, match="options: dict is not allowed; allowed: a CheckOptions"):
        check_cache_with(model, PROMPT, fields)  # type: ignore[arg-type]


def test_the_check_study_builds_its_options_from_the_config():
    from kvfast.studies.check import check_options

    options = check_options({"steps": 6, "mode": "control", "scenarios": "both"})
    assert options == CheckOptions(6, "control", ("decode", "resume"))


# --- layout -----------------------------------------------------------------------------------

CHECKER = (
    "checker.py", "subject.py", "reference.py", "judge.py", "report.py", "options.py", "scenarios/base.py",
    "scenarios/decode.py", "scenarios/resume.py", "scenarios/rollback.py", "scenarios/fork.py",
)  # fmt: skip


def test_the_checker_validates_logits_only_through_model_calls():
    """Every model call of the checker returns validated logits through ``ModelCalls`` (kvfast/check/protocol.py):
    no other checker module calls ``check_logits`` or a model's logits method itself."""
    for name in CHECKER:
        tree = ast.parse((ROOT / "kvfast" / "check" / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Name | ast.alias):
                assert getattr(node, "id", getattr(node, "name", None)) != "check_logits", name
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in ("prefill", "extend", "decode", "recompute", "recompute_variants"):
                    receiver = node.func.value
                    assert isinstance(receiver, ast.Name | ast.Attribute), name
                    text = ast.unparse(receiver)
                    assert text.endswith("calls"), f"{name}: {ast.unparse(node)} is not a ModelCalls call"


def test_no_function_of_the_check_package_is_over_80_lines():
    long = []
    for path in sorted((ROOT / "kvfast" / "check").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    long.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def test_kvfast_check_builds_its_options_from_the_flags():
    from types import SimpleNamespace

    from kvfast.commands.check import check_options

    flags = dict(continuation=None, split=None, margin=None, decisive=20.0, steps=None, mode="control")
    args = SimpleNamespace(scenarios="decode, resume", per_step=True, promote=True, **flags)
    assert check_options(args) == CheckOptions(64, "control", fast=False, decisive=20.0, promote="float64")
    args = SimpleNamespace(**{**vars(args), "continuation": "7,8,9", "promote": False, "scenarios": "resume"})
    assert check_options(args) == CheckOptions(
        3, "control", "resume", fast=False, decisive=20.0, continuation=(7, 8, 9)
    )
    with pytest.raises(ValueError, match="scenarios: 'warp' is not allowed"):
        check_options(SimpleNamespace(**{**vars(args), "scenarios": "decode,warp"}))
