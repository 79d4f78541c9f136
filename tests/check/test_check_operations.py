"""The cache operations' scenarios (kvfast.check.scenarios): rollback and fork.

On kvfast's own model both are bit-exact (exact mode, ``==``); on the protocol's toy with the hooks too;
on tiny random Hugging Face models (Llama, GPT-2, Mistral with its window, Qwen2) clean runs are never
``bug`` nor ``inconclusive`` in control mode, float32 and bfloat16 with the float64 logic check (the full
matrix, 2 seeds x 2 prompts, is ``-m slow``). Each operation bug (:data:`OP_BUGS`) is found at the step
where it first acts (:func:`op_first_acting_step`); a model without the hooks, or whose hook raises
``NotImplementedError``, gets the scenario skipped with a note.
"""

from __future__ import annotations

import pytest

from kvfast import ModelConfig, init_params
from kvfast.bugs.operations import OP_BUGS, inject_op_bug, op_first_acting_step
from kvfast.check import CheckOptions, KvfastModel, ModelUnderTestError, check_cache
from kvfast.check.options import ALL_SCENARIOS, SCENARIOS
from kvfast.check.scenarios import BRANCH
from kvfast.check.scenarios.rollback import rollback_points
from tests.toymodels import Toy, ToyOps

pytest_plugins = ["pytester"]

CFG = ModelConfig(vocab=64, d_model=32, n_head=4, n_layer=2, d_ff=64, max_pos=64)
PROMPT = [1, 2, 3, 4, 5]
STEPS = 20
OPS = ("rollback", "fork")


def kvfast_model(bug: str | None = None, numerics: str = "f64") -> KvfastModel:
    return inject_op_bug(KvfastModel(CFG, init_params(CFG, 0), numerics), bug)


# --- kvfast's own model: bit-exact -------------------------------------------------------------------


@pytest.mark.parametrize("follow", ["recompute", "cache"])
def test_kvfast_model_is_bit_exact_through_rollback_and_fork(follow):
    report = check_cache(kvfast_model(), PROMPT, STEPS, scenarios=("decode",) + OPS, follow=follow)
    assert report.verdict == "exact", report.format()
    assert set(report.scenarios) == {"decode", "rollback", "fork", BRANCH}
    for s in report.scenarios.values():
        assert s.first_divergent_step is None and (s.deviation == 0).all()
    assert report.scenarios[BRANCH].steps == STEPS // 2


def test_control_mode_and_the_same_table():
    report = check_cache(kvfast_model(), PROMPT, STEPS, mode="control", scenarios=OPS)
    assert report.verdict == "rounding"
    rollback = report.scenarios["rollback"]
    assert rollback.deviation.shape == (STEPS + 1,) and rollback.bounds.ratio.shape == (STEPS + 1,)
    assert any("rollbacks: before steps 1, 5, 9" in n for n in rollback.notes)
    assert "verdict" in rollback.table()


@pytest.mark.parametrize("mode", ["exact", "control"])
@pytest.mark.parametrize("bug", ["crop_short", "fork_shared_keys"])  # the reorder bugs: HFModel only
def test_each_operation_bug_is_found_where_it_first_acts(bug, mode):
    report = check_cache(kvfast_model(bug), PROMPT, STEPS, mode=mode, scenarios=OPS)
    assert not report.passed
    for name in OPS:
        s, want = report.scenarios[name], op_first_acting_step(bug, name, STEPS)
        found = s.first_divergent_step if mode == "exact" else s.first_bug_step
        assert found == want, (name, report.format())
    assert report.scenarios[BRANCH].passed  # the second branch sees a clean cache: the first is the one changed


def test_the_protocol_toy_with_hooks():
    report = check_cache(ToyOps(), [1, 2, 3], 12, scenarios=OPS, mode="exact")
    assert report.verdict == "exact", report.format()

    class ShortCrop(ToyOps):
        def crop(self, n):
            super().crop(n + 1 if n < len(self.sums) else n)

    bad = check_cache(ShortCrop(), [1, 2, 3], 12, scenarios=OPS, mode="exact")
    assert bad.scenarios["rollback"].first_divergent_step == 1
    assert bad.scenarios["fork"].verdict == "exact"


# --- skipped, never a crash ----------------------------------------------------------------------------


def test_a_model_without_hooks_is_skipped_with_a_note():
    reorder = check_cache(kvfast_model(), PROMPT, 4, scenarios="reorder").scenarios["reorder"]
    assert reorder.verdict == "skipped"
    assert reorder.notes == ("the model has no prefill_beams() and decode_beams() and reorder()",)
    report = check_cache(Toy(), [1, 2, 3], 8, scenarios=("decode",) + OPS)
    assert report.verdict == "exact" and report.passed
    assert report.scenarios["rollback"].verdict == "skipped"
    assert report.scenarios["rollback"].notes == ("the model has no crop()",)
    assert "reorder" in OP_BUGS["reorder_keys_only"].description
    assert report.scenarios["fork"].notes == ("the model has no snapshot() and restore()",)
    assert "skipped (the model has no crop())" in report.format()


def test_a_hook_raising_not_implemented_is_skipped_and_any_other_error_is_the_models():
    class Declines(ToyOps):
        def crop(self, n):
            raise NotImplementedError("this cache cannot roll back")

    report = check_cache(Declines(), [1, 2, 3], 8, scenarios=OPS)
    note = report.scenarios["rollback"].notes[0]
    assert report.scenarios["rollback"].verdict == "skipped" and "cannot roll back" in note and "crop(3)" in note
    assert report.scenarios["fork"].verdict == "exact"

    class Raises(ToyOps):
        def snapshot(self):
            raise KeyError("no")

    with pytest.raises(ModelUnderTestError, match=r"model\.snapshot\(\) raised KeyError"):
        check_cache(Raises(), [1, 2, 3], 8, scenarios="fork")


def test_options_accept_the_new_names_and_keep_the_default():
    assert CheckOptions(4).scenarios == SCENARIOS == ("decode", "resume")
    assert CheckOptions(4, scenarios="rollback").scenarios == ("rollback",)
    assert ALL_SCENARIOS == ("decode", "resume", "rollback", "fork", "reorder", "padded")
    with pytest.raises(
        ValueError, match=r"scenarios: 'beam' is not allowed; allowed: decode, fork, padded, reorder, resume, rollback"
    ):
        CheckOptions(4, scenarios=("decode", "beam"))


def test_an_operation_alone_on_a_one_token_prompt():
    report = check_cache(kvfast_model(), [7], 6, scenarios=OPS)
    assert report.verdict == "exact", report.format()
    assert rollback_points(6) == [1, 5]


def test_a_one_step_fork_still_runs_both_branches():
    report = check_cache(kvfast_model(), PROMPT, 1, scenarios="fork")
    assert report.verdict == "exact" and report.scenarios[BRANCH].steps == 1
    assert op_first_acting_step("fork_shared_keys", "fork", 1) is None


def test_inject_op_bug_refuses_bad_input():
    with pytest.raises(ValueError, match="bug: 'nope' is not allowed"):
        inject_op_bug(kvfast_model(), "nope")
    with pytest.raises(ValueError, match="model: Toy takes no operation bug"):
        inject_op_bug(Toy(), "crop_short")


# --- the command line, the fixture and the check study -----------------------------------------------


@pytest.mark.subprocess
def test_cli_takes_the_new_scenarios(capsys):
    from kvfast.cli import main

    rc = main(["check", "tests.toymodels:clean", "--prompt", "1,2,3", "--steps", "4", "--scenarios", "decode,fork"])
    out = capsys.readouterr().out
    assert rc == 0 and "fork: skipped" in out.replace("scenario 'fork': skipped", "fork: skipped")


def test_the_check_study_sweeps_the_operations():
    from kvfast.studies.check import SCENARIO_CHOICES

    assert SCENARIO_CHOICES["rollback"] == ("rollback",) and SCENARIO_CHOICES["fork"] == ("fork",)
    assert SCENARIO_CHOICES["operations"] == ("decode", "rollback", "fork", "reorder", "padded")
    assert SCENARIO_CHOICES["reorder"] == ("reorder",) and SCENARIO_CHOICES["padded"] == ("padded",)


def test_kv_check_fixture_takes_them(pytester):
    pytester.makepyfile(
        """
        from kvfast import ModelConfig, init_params
        from kvfast.check import KvfastModel

        def test_ops(kv_check):
            cfg = ModelConfig(vocab=32, d_model=16, n_head=2, n_layer=1, d_ff=32, max_pos=32)
            report = kv_check(KvfastModel(cfg, init_params(cfg, 0)), [1, 2, 3], 8, scenarios=("rollback", "fork"))
            assert report.verdict == "exact"
        """
    )
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_an_operation_only_check_reuses_the_fast_paths_run():
    """The fast path runs the first operation's path and the scenario reuses it: one prefill in all."""

    class Counting(ToyOps):
        prefills = 0

        def prefill(self, tokens):
            Counting.prefills += 1
            return super().prefill(tokens)

    report = check_cache(Counting(), [1, 2, 3], 8, scenarios="rollback")
    assert report.verdict == "exact" and report.path == "fast" and Counting.prefills == 1
    Counting.prefills = 0
    report = check_cache(Counting(), [1, 2, 3], 8, scenarios=("fork", "rollback"))
    assert report.verdict == "exact" and Counting.prefills == 2
    skipped = check_cache(Toy(), [1, 2, 3], 8, scenarios=OPS)  # the fast path falls back to a decode run
    assert [s.verdict for s in skipped.scenarios.values()] == ["skipped", "skipped"]
