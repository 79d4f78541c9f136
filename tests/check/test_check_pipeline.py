"""The checker as one pipeline (issue 27): a skipped scenario never passes, each decision is made once, and a new
scenario is one unit plus one registry line.

The five false passes found: a check whose every requested scenario was skipped passed (``check_cache``,
``assert_cache_exact``, ``kv_check``, the ``check`` study's rows, ``kvfast check``), and a hook raising
``NotImplementedError`` did the same. Each is ``unchecked`` now, which fails everywhere; each test below
would fail on the old checker.
"""

from __future__ import annotations

import ast
import re

import numpy as np
import pytest
from shared import ROOT

from kvfast import ModelConfig, init_params
from kvfast.check import KvfastModel, assert_cache_exact, check_cache
from kvfast.check.check_report import UNCHECKED
from kvfast.check.scenarios import REGISTRY, Run, Scenario
from kvfast.check.scenarios.base import decode_steps
from kvfast.cli import main
from tests.toymodels import Toy, ToyOps

pytest_plugins = ["pytester"]

CFG = ModelConfig(vocab=32, d_model=16, n_head=2, n_layer=1, d_ff=32, max_pos=64)
PROMPT = [1, 2, 3, 4, 5]
CHECK = ROOT / "kvfast" / "check"


def model(bug: str | None = None) -> KvfastModel:
    return KvfastModel(CFG, init_params(CFG, 0), "f64", bug)


class DeclinesCrop(Toy):
    """The toy with a crop hook that declines every rollback (a cache kind that cannot roll back)."""

    def crop(self, n):
        raise NotImplementedError("this cache cannot roll back")


# --- skipped is never passed ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["exact", "control"])
@pytest.mark.parametrize("bug", [None, "posfrozen"])
def test_a_check_where_no_requested_scenario_ran_is_unchecked_and_fails(mode, bug):
    report = check_cache(model(bug), PROMPT, 8, mode=mode, scenarios=("reorder",))
    assert report.verdict == UNCHECKED and not report.passed
    assert report.ran == [] and set(report.skipped) == {"reorder"}
    text = report.format()  # no crash on a report with nothing to tabulate (it raised IndexError)
    lines = text.splitlines()
    assert lines[0].startswith("kvfast check: FAIL: UNCHECKED (")
    assert lines[1].startswith("no requested scenario ran") and "reorder (the model has no prefill_beams()" in lines[1]
    assert np.isnan(report.max_deviation) and report.deviation.shape == (0,)


def test_assert_cache_exact_fails_when_nothing_ran():
    with pytest.raises(AssertionError, match="FAIL: UNCHECKED"):
        assert_cache_exact(model("posfrozen"), PROMPT, 8, scenarios=("reorder", "padded"))


def test_a_hook_that_declines_every_run_is_unchecked():
    report = check_cache(DeclinesCrop(), [1, 2, 3], 8, scenarios=("rollback",))
    assert report.verdict == UNCHECKED and not report.passed
    assert "cannot roll back" in report.skipped["rollback"]


def test_some_ran_passes_on_what_ran_and_says_what_was_skipped_in_its_first_lines():
    report = check_cache(model(), PROMPT, 8, scenarios=("decode", "reorder"))
    assert report.verdict == "exact" and report.passed
    second = report.format().splitlines()[1]
    assert second.startswith("skipped (not checked; the verdict covers only decode): reorder (the model has no")
    # the bug is still found by what ran
    bugged = check_cache(model("posfrozen"), PROMPT, 8, scenarios=("decode", "reorder"))
    assert bugged.verdict == "bug" and not bugged.passed


@pytest.mark.parametrize("mode", ["exact", "control"])
def test_strict_makes_any_skip_fail(mode):
    report = check_cache(model(), PROMPT, 8, mode=mode, scenarios=("decode", "reorder"), strict=True)
    assert report.verdict == UNCHECKED and not report.passed
    assert report.format().splitlines()[1].startswith("strict: a requested scenario was skipped")
    whole = check_cache(model(), PROMPT, 8, mode=mode, scenarios=("decode", "resume"), strict=True)
    assert whole.passed  # strict with nothing skipped is the plain check
    found = check_cache(model("posfrozen"), PROMPT, 8, mode=mode, scenarios=("decode", "reorder"), strict=True)
    assert found.verdict == ("divergent" if mode == "exact" else "bug")  # a bug found stays the bug, never unchecked


def test_kv_check_fails_when_nothing_ran(pytester):
    pytester.makepyfile(
        """
        from kvfast import ModelConfig, init_params
        from kvfast.check import KvfastModel

        def test_nothing_checked(kv_check):
            cfg = ModelConfig(vocab=32, d_model=16, n_head=2, n_layer=1, d_ff=32, max_pos=64)
            kv_check(KvfastModel(cfg, init_params(cfg, 0), "f64", "posfrozen"), [1, 2, 3], 8,
                     scenarios=("reorder", "padded"))
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*FAIL: UNCHECKED*", "*no requested scenario ran*reorder*padded*"])


def test_the_check_study_row_of_an_unchecked_check_is_not_passed(tmp_path):
    from kvfast.studies.check import check_one, kvfast_model

    config = {
        "seed": 0, "n_layer": 1, "n_head": 2, "d_model": 16, "d_ff": 32, "vocab": 32, "preset": "f64",
        "order": "sequential", "attention": "standard", "prompt_seed": 0, "prompt_len": 5, "steps": 6,
        "mode": "exact", "scenarios": "reorder", "promote": "none",
    }  # fmt: skip
    for bug in ("none", "posfrozen", "stale"):
        built = kvfast_model(**{k: config[k] for k in ("seed", "n_layer", "n_head", "d_model", "d_ff", "vocab",
                                                      "preset", "order", "attention")}, bug=bug)  # fmt: skip
        row = check_one(built, config)
        assert row["verdict"] == UNCHECKED and row["passed"] is False


@pytest.mark.subprocess
def test_kvfast_check_exits_7_with_the_scenarios_and_why(capsys):
    rc = main(["check", "tests.toymodels:posfrozen", "--prompt", "1,2,3", "--steps", "6", "--scenarios", "reorder"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 7, out
    assert out[0].startswith("kvfast check: FAIL: UNCHECKED (") and re.match(
        r"no requested scenario ran.*reorder \(the model has no", out[1]
    )


@pytest.mark.subprocess
def test_kvfast_check_strict_exits_7_where_the_plain_check_passes(capsys):
    args = ["check", "tests.toymodels:clean", "--prompt", "1,2,3", "--steps", "6", "--scenarios", "decode,fork"]
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args, "--strict"]) == 7
    assert "strict: a requested scenario was skipped" in capsys.readouterr().out


# --- one scenario, one unit ----------------------------------------------------------------------------------


class Replay(Scenario):
    """A scenario added by a test: prefill the prompt twice on one cache (a server reusing a slot), then decode.
    The second prefill must reset the cache: a cache that keeps the first one's positions is a bug."""

    name = "replay"

    def run(self, calls, prompt, split, steps, choose) -> Run:
        calls.prefill(prompt, "of the prompt (first time)")
        first = calls.prefill(prompt, "of the prompt (again, the cache reset)")
        return Run(decode_steps(calls, first, steps, choose), ("the prompt was prefilled twice",))


class NoReset(Toy):
    """The toy whose prefill forgets to reset its position counter when the cache is reused."""

    def prefill(self, tokens):
        again = hasattr(self, "n")
        out = super().prefill(tokens)
        if again:
            self.n += len(tokens)
        return out


@pytest.mark.subprocess
def test_a_new_scenario_is_one_unit_and_one_registry_line(monkeypatch):
    monkeypatch.setitem(REGISTRY, "replay", Replay())  # the one line
    for mode, clean_verdict in (("exact", "exact"), ("control", "rounding")):
        report = check_cache(Toy(), [1, 2, 3], 8, mode=mode, scenarios=("decode", "replay"))
        assert report.verdict == clean_verdict and report.scenarios["replay"].notes == (
            "the prompt was prefilled twice",
        )
        assert "scenarios: decode, replay" in report.format()
    bugged = check_cache(NoReset(), [1, 2, 3], 8, scenarios="replay")
    assert not bugged.passed and bugged.scenarios["replay"].first_divergent_step == 1
    assert main(["check", "tests.toymodels:clean", "--prompt", "1,2,3", "--steps", "4", "--scenarios", "bogus"]) == 2


# --- each decision in one place ------------------------------------------------------------------------------


def _sources() -> dict[str, str]:
    return {str(p.relative_to(CHECK)): p.read_text() for p in CHECK.rglob("*.py")}


def test_the_mode_is_decided_in_the_judge_alone():
    """Only the judge (and the options that validate it, and the report that prints it) compares the mode."""
    pattern = re.compile(r"mode\s*(==|!=|in\b)|\.mode\s*(==|!=)")
    found = {f for f, text in _sources().items() if pattern.search(text)}
    assert found <= {"judge.py", "options.py", "check_report.py"}, found


def test_ulp_is_written_once():
    found = [f for f, text in _sources().items() if re.search(r"^def ulp\(", text, re.M)]
    assert found == ["formats.py"]


def _code_strings(text: str) -> set[str]:
    """The string constants a module's code uses (docstrings left out: prose may name a scenario)."""
    tree = ast.parse(text)
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    }


def test_a_scenario_is_named_only_by_its_unit_and_the_registry():
    """A scenario's name appears in code only in its unit: adding one touches no other module of the checker
    (the protocol's method names, ``decode`` and ``reorder``, are the model's, not the scenarios')."""
    names = [n for n in REGISTRY if n != "replay"]
    for f, text in _sources().items():
        if f.startswith("scenarios/") or f == "protocol.py":
            continue
        found = set(names) & _code_strings(text)  # a name as a value: a comparison, a key, a default
        assert not found, (f, found)


def test_the_scenario_finder_finds_a_name():
    """The finder above is not blind: a module that names a scenario in code is found, in a docstring it is not."""
    assert "resume" in _code_strings('"""The resume scenario."""\nif name == "resume":\n    pass\n')
    assert "resume" not in _code_strings('"""resume"""\ndef f():\n    """resume"""\n')


def test_a_logic_check_that_runs_no_scenario_is_skipped_and_the_native_verdict_stands():
    """Issue 42: a promoted model without the hooks a scenario needs ran nothing; the check exited 1 while its report
    said ROUNDING. Now the logic check is skipped with a note naming why and the native verdict decides."""

    class Promotable(ToyOps):
        def promote(self, dtype):
            return Toy()  # the plain toy: no crop, no snapshot

    report = check_cache(Promotable(), PROMPT, 8, scenarios="rollback", promote="float64")
    assert report.passed and report.verdict == "exact" and report.promoted is None, report.format()
    assert any(n.startswith("the logic check in float64 was skipped: the promoted model ran no scenario") for n in
               report.notes), report.notes  # fmt: skip
    both = check_cache(Promotable(), PROMPT, 8, scenarios=("decode", "rollback"), promote="float64")  # the control
    assert both.passed and both.promoted is not None and "rollback" in both.promoted.skipped
