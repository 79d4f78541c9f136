"""The ``recompute_prefixes`` shortcut (issue 46): the recompute of a sequence and of the prefix the append-invariance
check takes, in one call, are bit for bit the recomputes one call each returns, and a check that takes the shortcut
reports what one that does not reports."""

from __future__ import annotations

import numpy as np
import pytest
from shared import SHORTCUT_CHECKS, same_report

from kvfast.check import KvfastModel, ModelUnderTestError, check_cache
from kvfast.check.lossy import LossyKvfastModel
from kvfast.model.config import ModelConfig, init_params
from kvfast.numerics import Numerics

CFG = ModelConfig(vocab=32, d_model=16, n_head=2, n_layer=2, d_ff=32, max_pos=24)
PARAMS = init_params(CFG, 3)
PROMPT = np.array([3, 1, 4, 1, 5])
TOKENS = np.random.default_rng(0).integers(0, CFG.vocab, 19)


class OneCallEach(KvfastModel):
    """kvfast's model without the shortcut: the checker recomputes each prefix in a call of its own."""

    recompute_prefixes = None


class Counting(KvfastModel):
    """Counts the shortcut's calls and ``recompute``'s."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = {"recompute_prefixes": 0, "recompute": 0}

    def recompute_prefixes(self, tokens, lengths):
        self.calls["recompute_prefixes"] += 1
        return super().recompute_prefixes(tokens, lengths)


class CountingRecompute(Counting):
    """Counts ``recompute`` too: overriding it, the model's shortcut declines (each prefix goes through it)."""

    def recompute(self, tokens):
        self.calls["recompute"] += 1
        return super().recompute(tokens)


class Breaks(KvfastModel):
    def recompute_prefixes(self, tokens, lengths):
        raise RuntimeError("the hook broke")


class TooFew(KvfastModel):
    def recompute_prefixes(self, tokens, lengths):
        return super().recompute_prefixes(tokens, lengths)[:1]


NUMERICS = [
    Numerics.preset("f64"),
    Numerics.preset("bf16", "pairwise"),
    Numerics.preset("f32", attention="splitcount"),
    Numerics.preset("f32", "pairwise", attention="online"),
]


@pytest.mark.parametrize("numerics", NUMERICS, ids=lambda n: n.name)
def test_each_prefix_is_bit_for_bit_its_own_recompute(numerics):
    model = KvfastModel(CFG, PARAMS, numerics)
    lengths = [19, 7, 1, 12, 19]
    rows = model.recompute_prefixes(TOKENS, lengths)
    assert [r.shape for r in rows] == [(n, CFG.vocab) for n in lengths]
    for n, got in zip(lengths, rows, strict=True):
        assert got.tobytes() == model.recompute(TOKENS[:n]).tobytes(), n


def test_each_prefix_is_computed_alone():
    """Control: where a row depends on the batch's length (attention split in a count of blocks of the keys), a
    prefix's rows are not the longer recompute's: each prefix is a forward of its own, not a slice of another."""
    model = KvfastModel(CFG, PARAMS, Numerics.preset("f32", attention="splitcount"))
    rows = model.recompute_prefixes(TOKENS, [19, 12])
    assert rows[1].tobytes() != rows[0][:12].tobytes()


def test_bad_lengths_are_bad_input():
    model = KvfastModel(CFG, PARAMS, "f64")
    with pytest.raises(ValueError, match="^lengths: 20 is not allowed"):
        model.recompute_prefixes(TOKENS, [20])
    with pytest.raises(ValueError, match="^lengths: 0 is not allowed"):
        model.recompute_prefixes(TOKENS, [0])
    with pytest.raises(ValueError, match=r"^lengths: \[\] is not allowed"):
        model.recompute_prefixes(TOKENS, [])


def test_a_model_that_overrides_recompute_declines_the_shortcut():
    """A subclass that changes recompute (a lossy model's, a counting one) is recomputed through its own."""
    with pytest.raises(NotImplementedError, match="recompute"):
        CountingRecompute(CFG, PARAMS, "f64").recompute_prefixes(TOKENS, [19, 7])
    model = KvfastModel(CFG, PARAMS, "f64")
    model.recompute = lambda tokens: KvfastModel.recompute(model, tokens)  # replaced on the instance
    with pytest.raises(NotImplementedError, match="recompute"):
        model.recompute_prefixes(TOKENS, [19, 7])
    lossy = LossyKvfastModel(CFG, PARAMS, "f64", fmt="int8")
    if type(lossy).recompute is not KvfastModel.recompute:
        with pytest.raises(NotImplementedError):
            lossy.recompute_prefixes(TOKENS, [19, 7])


@pytest.mark.parametrize("options", SHORTCUT_CHECKS)
@pytest.mark.parametrize("bug", [None, "stale", "posfrozen", "maskfrozen"])
def test_a_check_with_the_shortcut_reports_what_one_call_per_recompute_reports(options, bug):
    numerics = "bf16" if options.get("mode") == "control" else "f64"
    fast = check_cache(Counting(CFG, PARAMS, numerics, bug), PROMPT, 12, keep_logits=True, **options)
    slow = check_cache(OneCallEach(CFG, PARAMS, numerics, bug), PROMPT, 12, keep_logits=True, **options)
    assert same_report(fast, slow)
    # control: the comparison sees a report of another bug
    other = check_cache(OneCallEach(CFG, PARAMS, numerics, "noscale"), PROMPT, 12, keep_logits=True, **options)
    assert not same_report(fast, other)


def test_the_shortcut_takes_the_whole_sequence_and_its_prefix_in_one_call():
    model = Counting(CFG, PARAMS, "f64")
    check_cache(model, PROMPT, 12, scenarios="decode", follow="cache")
    assert model.calls["recompute_prefixes"] == 1
    model = CountingRecompute(CFG, PARAMS, "f64")  # declines: the prompt's, the whole sequence's, the prefix's
    check_cache(model, PROMPT, 12, scenarios="decode", follow="cache")
    assert model.calls == {"recompute_prefixes": 1, "recompute": 3}


def test_a_not_append_invariant_recompute_is_still_found_through_the_shortcut():
    """A recompute whose rows change with the batch's length (a length-dependent model) is caught as before."""

    class LengthDependent(KvfastModel):
        def recompute_prefixes(self, tokens, lengths):
            rows = super().recompute_prefixes(tokens, lengths)
            return [r + 1e-9 * (r.shape[0] % 2) for r in rows]

    report = check_cache(LengthDependent(CFG, PARAMS, "f64"), PROMPT, 12, scenarios="decode", follow="cache")
    assert any("not append-invariant" in n for n in report.notes), report.notes


def test_a_shortcut_that_raises_or_returns_too_few_is_the_models_failure():
    with pytest.raises(ModelUnderTestError, match=r"^model.recompute_prefixes\(<\d+ tokens>, \[\d+, \d+\]\) raised "):
        check_cache(Breaks(CFG, PARAMS, "f64"), PROMPT, 12, follow="cache")
    with pytest.raises(ValueError, match=r"^model.recompute_prefixes: returned list; allowed: a list of 2 logits "):
        check_cache(TooFew(CFG, PARAMS, "f64"), PROMPT, 12, follow="cache")
