"""kvfast.check in exact mode: correct models pass, every catalogue bug is flagged at its signature step,
the resume scenario catches offset bugs plain decoding misses, the fast path agrees with the per-step path,
and bad input is a clear ValueError."""

from __future__ import annotations

import numpy as np
import pytest
from toymodels import Toy

import kvfast
from kvfast import ModelConfig, Numerics, init_params
from kvfast.check import KvfastModel, NumpyModel, assert_cache_exact, check_cache
from kvfast.check.numpy_model import RESUME_BUGS
from kvfast.model.bugs import BUGS, VISIBLE_AT_STEP_1

CFG = ModelConfig(vocab=32, d_model=16, n_head=2, n_layer=2, d_ff=32, max_pos=48)
PROMPT = [3, 1, 4, 1, 5, 9]
TOY_PROMPT = [3, 1, 4, 1, 5, 2]
STEPS = 20  # > EVICT_WINDOW - len(PROMPT): evict bites


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 0)


@pytest.fixture(scope="module")
def npz(tmp_path_factory, params):
    path = tmp_path_factory.mktemp("check") / "model.npz"
    kvfast.save_params(path, CFG, params)
    return path


# --- correct implementations pass ------------------------------------------------------------


@pytest.mark.parametrize("preset", ["f64", "f32", "bf16"])
def test_kvfast_model_is_exact_in_every_preset(params, preset):
    for order in ("sequential", "pairwise"):
        report = check_cache(KvfastModel(CFG, params, Numerics.preset(preset, order)), PROMPT, STEPS)
        assert report.verdict == "exact" and report.passed
        assert report.path == "fast"
        assert set(report.scenarios) == {"decode", "resume"}
        for s in report.scenarios.values():
            assert s.deviation.shape == (STEPS + 1,) and (s.deviation == 0).all()
            assert s.first_divergent_step is None


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_numpy_reference_model_is_exact_with_one_row_products(npz, dtype):
    report = check_cache(NumpyModel.from_npz(npz, dtype=dtype), PROMPT, STEPS)
    assert report.verdict == "exact"


def test_numpy_reference_model_matches_kvfast_to_rounding(npz, params):
    """Written from the architecture, it computes the same function (in another summation order)."""
    ours = KvfastModel(CFG, params).recompute(np.array(PROMPT))
    ref = NumpyModel.from_npz(npz).recompute(np.array(PROMPT))
    assert np.abs(ours - ref).max() <= 1e-12 * np.abs(ours).max()


def test_greedy_tokens_come_from_the_recompute(params):
    model = KvfastModel(CFG, params)
    report = check_cache(model, PROMPT, STEPS, scenarios="decode")
    seq = list(PROMPT)
    for i in range(STEPS):
        assert report.tokens[i] == int(np.argmax(model.recompute(np.array(seq))[-1]))
        seq.append(int(report.tokens[i]))


# --- every catalogue bug at the step its signature says ----------------------------------------


@pytest.mark.parametrize("bug", list(BUGS))
def test_catalogue_bug_flagged_at_its_signature_step(params, bug):
    report = check_cache(KvfastModel(CFG, params, bug=bug), PROMPT, STEPS, mode="exact")
    assert report.verdict == "divergent" and not report.passed
    for s in report.scenarios.values():
        assert s.deviation[0] == 0.0  # the prefill is never touched by a decode bug
        if VISIBLE_AT_STEP_1[bug]:
            assert s.first_divergent_step == 1 and s.deviation[1] > 0
        else:
            assert s.deviation[1] == 0.0 and s.first_divergent_step >= 2
    # the first step is the same whichever reference path computed it, and so is every deviation
    slow = check_cache(KvfastModel(CFG, params, bug=bug), PROMPT, STEPS, fast=False, mode="exact")
    assert slow.path == "per-step"
    for name, s in report.scenarios.items():
        assert np.array_equal(s.deviation, slow.scenarios[name].deviation)
        assert np.array_equal(s.tokens, slow.scenarios[name].tokens)


def test_growth_bugs_first_steps(params):
    """The exact step of each growth bug in this scenario follows from its line (prompt of 6, window 16)."""
    expect = {"freeze": 2, "posfrozen": 2, "maskfrozen": 2, "evict": 16 - len(PROMPT) + 1}
    for bug, step in expect.items():
        report = check_cache(KvfastModel(CFG, params, bug=bug), PROMPT, STEPS, scenarios="decode")
        assert report.first_divergent_step == step, bug


def test_clean_path_with_bug_none_is_exact_and_not_the_bugged_one(params):
    clean = check_cache(KvfastModel(CFG, params, bug=None), PROMPT, 4)
    bugged = check_cache(KvfastModel(CFG, params, bug="posoff"), PROMPT, 4)
    assert clean.passed and not bugged.passed


# --- resume ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bug", list(RESUME_BUGS))
def test_resume_scenario_catches_offset_bugs_plain_decoding_misses(npz, bug):
    model = NumpyModel.from_npz(npz, bug=bug)
    plain = check_cache(model, PROMPT, STEPS, scenarios="decode", mode="exact")
    assert plain.verdict == "exact"
    resumed = check_cache(model, PROMPT, STEPS, scenarios="resume", mode="exact")
    assert resumed.verdict == "divergent"
    assert resumed.scenarios["resume"].split == len(PROMPT) // 2


def test_resume_without_extend_feeds_the_second_chunk_through_decode():
    report = check_cache(Toy(), TOY_PROMPT, 8)
    assert report.verdict == "exact"
    assert "no extend()" in " ".join(report.scenarios["resume"].notes)
    # posfrozen in a resumed session goes wrong inside the prompt, plain decoding only at step 2
    bugged = check_cache(Toy("posfrozen"), TOY_PROMPT, 8)
    assert bugged.scenarios["decode"].first_divergent_step == 2
    assert bugged.scenarios["resume"].first_divergent_step == 0
    assert bugged.scenarios["resume"].first_divergent_position == len(PROMPT) // 2 + 1


def test_one_token_prompt_skips_resume():
    report = check_cache(Toy(), [2], 5)
    assert report.scenarios["resume"].verdict == "skipped"
    assert report.scenarios["decode"].verdict == "exact"
    assert report.verdict == "exact"


def test_split_chooses_the_chunks(npz):
    model = NumpyModel.from_npz(npz, bug="extend_from_zero")
    report = check_cache(model, PROMPT, 3, scenarios="resume", split=5)
    assert report.scenarios["resume"].split == 5
    assert report.scenarios["resume"].first_divergent_position == 5


# --- the fast path and its fallback --------------------------------------------------------------


def test_fast_path_falls_back_when_recompute_is_not_append_invariant(npz):
    model = NumpyModel.from_npz(npz, dtype="float32", batching="matrix")
    report = check_cache(model, PROMPT, 6, mode="exact")
    assert report.path == "per-step"
    assert any("not append-invariant" in n for n in report.notes)


class CountingToy(Toy):
    def __init__(self, bug=None):
        super().__init__(bug)
        self.recomputes = 0

    def recompute(self, tokens):
        self.recomputes += 1
        return super().recompute(tokens)


def test_fast_path_recomputes_a_constant_number_of_times_per_scenario_set():
    fast, slow = CountingToy(), CountingToy()
    check_cache(fast, TOY_PROMPT, 30, scenarios="decode")
    check_cache(slow, TOY_PROMPT, 30, scenarios="decode", fast=False)
    assert fast.recomputes == 3  # prompt, whole sequence, one prefix to verify append-invariance
    assert slow.recomputes == 1 + 30 + 1  # and the whole sequence once: is the recompute length-dependent?


# --- messages ----------------------------------------------------------------------------------


def test_assert_cache_exact_message_names_step_deviation_and_context(params):
    with pytest.raises(AssertionError) as err:
        assert_cache_exact(KvfastModel(CFG, params, bug="posfrozen"), PROMPT, 8, scenarios="decode")
    msg = str(err.value)
    report = check_cache(KvfastModel(CFG, params, bug="posfrozen"), PROMPT, 8, scenarios="decode")
    s = report.scenarios["decode"]
    assert "first divergent step 2 (position 7)" in msg
    assert f"{s.deviation[2]:.6g}" in msg
    ctx = ", ".join(map(str, [*PROMPT, *s.tokens[:2]]))
    assert f"context tokens up to position 7: [{ctx}]" in msg
    assert "<- first" in msg
    assert assert_cache_exact(KvfastModel(CFG, params), PROMPT, 4).passed


def test_logits_may_be_lists_or_have_a_batch_axis():
    class Batched(Toy):
        def recompute(self, tokens):
            return [super().recompute(tokens).tolist()]

        def decode(self, token):
            return super().decode(token)[None, :]

    assert check_cache(Batched(), TOY_PROMPT, 5).verdict == "exact"


# --- bad input ---------------------------------------------------------------------------------


class NoDecode:
    def recompute(self, tokens):
        return np.zeros((len(tokens), 3))

    def prefill(self, tokens):
        return np.zeros((len(tokens), 3))


def _bad(method, result):
    class Bad(Toy):
        pass

    orig = getattr(Toy, method)

    def patched(self, *args):
        return result(orig(self, *args))

    setattr(Bad, method, patched)
    return Bad()


@pytest.mark.parametrize(
    "model, prompt, steps, kwargs, needle",
    [
        (NoDecode(), [1], 2, {}, "has no method 'decode'"),
        (Toy(), [], 2, {}, "prompt: shape (0,)"),
        (Toy(), [1, 7], 2, {}, "prompt: token 7 is out of range; allowed: integers in [0, 7)"),
        (Toy(), [1, -1], 2, {}, "prompt: token -1 is out of range"),
        (Toy(), [1.5], 2, {}, "prompt: dtype float64"),
        (Toy(), [1], 0, {}, "steps: 0 is not allowed"),
        (Toy(), [1], 2, {"mode": "loose"}, "mode: 'loose' is not allowed"),
        (Toy(), [1], 2, {"scenarios": ("decode", "warp")}, "scenarios: 'warp' is not allowed"),
        (Toy(), [1, 2, 3], 2, {"split": 3}, "split: 3 is not allowed"),
        (Toy(), [1], 2, {"margin": 0.5}, "margin: 0.5 is not allowed"),
        (Toy(), [1], 2, {"scenarios": "resume"}, "cannot run on this prompt (the prompt has one token"),
        (Toy(), [1], 2, {"split": 1}, "split: 1 is not allowed; allowed: None"),
        (Toy(), [1], 2, {"fast": "yes"}, "fast: 'yes' is not allowed"),
        (
            _bad("decode", lambda out: out[:3]),
            [1, 2],
            2,
            {},
            "model.decode at step 1 (position 2): logits of shape (3,)",
        ),
        (_bad("recompute", lambda out: out.T), [1, 2], 2, {}, "model.recompute of the prompt: logits of shape (7, 2)"),
        (_bad("decode", lambda out: out * np.nan), [1, 2], 2, {}, "logits hold nan"),
        (_bad("prefill", lambda out: np.where(out > 0, np.inf, out)), [1, 2], 2, {}, "logits hold inf"),
        (_bad("decode", lambda out: out.astype(str)), [1, 2], 2, {}, "logits of dtype <U"),
    ],
)
def test_bad_input_is_a_clear_value_error(model, prompt, steps, kwargs, needle):
    with pytest.raises(ValueError) as err:
        check_cache(model, prompt, steps, **kwargs)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    "name, value, needle",
    [("decode", 5, "has no method 'decode'"), ("extend", 3, "model.extend: 3 is not callable")],
)
def test_kvfast_model_with_a_method_replaced_on_the_instance_is_checked(params, name, value, needle):
    """kvfast's own model skips the protocol's method checks only while its methods are its class's
    (kvfast.check.subject): one replaced on the instance is checked as any model's (without the check, the
    decode case runs and passes: the greedy decode calls the kernel, not the instance's decode)."""
    model = KvfastModel(CFG, params)
    setattr(model, name, value)
    with pytest.raises(ValueError) as err:
        check_cache(model, [1, 2, 3], 2)
    assert needle in str(err.value)


def test_vocab_size_is_learned_from_the_logits_without_the_attribute():
    class Anonymous(Toy):
        vocab_size = None

    with pytest.raises(ValueError, match=r"prompt: token 9 is out of range; allowed: integers in \[0, 7\)"):
        check_cache(Anonymous(), [1, 9], 2)
    assert check_cache(Anonymous(), [1, 2], 3).verdict == "exact"
