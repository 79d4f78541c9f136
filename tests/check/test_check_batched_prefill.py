"""Issue 18, rule 5: no alarm on a correct model whose prefill is batched and whose decode is row by row.

The model (examples/batched_prefill_model.py) offers the plain protocol only (no ``recompute_variants``, no
``promote``), in float32 and bfloat16, with ``extend``. Control mode must call it ``rounding`` in both scenarios:
over the example's grid, 0 ``bug`` and 0 ``inconclusive`` (20 runs by default, 200 with ``-m slow``). Before the
method of :mod:`kvfast.check.control` (odd prefix lengths and the steps factor) the grid's run 2 (a prompt of 16
tokens, 32 steps: every prefix length a multiple of 8, so the recompute looked append-invariant and no noise was
measured) was ``inconclusive`` at 8x a one-ulp bound (OpenBLAS's kernels on an Intel CPU; the test pads the
recompute to make that premise hold on every CPU); the tests below rebuild that old statistic and see it fail, and
see a cache bug in the same model still found at the step where it first acts.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from statistics import NormalDist

import numpy as np
import pytest
from shared import ROOT

from kvfast.check import check_cache
from kvfast.check import control as C

EXAMPLE = ROOT / "examples" / "batched_prefill_model.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("batched_prefill_model", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _verdicts(example, dtype: str, runs: int) -> tuple[Counter, float]:
    counts: Counter = Counter()
    worst = 0.0
    for seed, prompt, continuation in example.grid(runs):
        model = example.BatchedPrefillModel(seed, dtype)
        report = check_cache(model, prompt, continuation=continuation, mode="control")
        assert set(report.scenarios) == {"decode", "resume"}
        counts.update(s.verdict for s in report.scenarios.values())
        worst = max(worst, report.max_ratio)
    return counts, worst


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_twenty_runs_are_rounding_in_both_scenarios(example, dtype):
    counts, worst = _verdicts(example, dtype, 20)
    assert counts == Counter({"rounding": 40}), counts
    assert worst <= C.DEFAULT_MARGIN


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_hundred_runs_are_rounding_in_both_scenarios(example, dtype):
    counts, worst = _verdicts(example, dtype, 200)
    assert counts == Counter({"rounding": 400}), counts
    assert worst <= C.DEFAULT_MARGIN


def test_the_model_is_plain_and_its_paths_really_differ(example):
    model = example.BatchedPrefillModel(0, "float32")
    assert not hasattr(model, "recompute_variants") and not hasattr(model, "promote")
    _, prompt, continuation = list(example.grid(3))[2]
    exact = check_cache(model, prompt, continuation=continuation, mode="exact")
    assert exact.verdict == "divergent" and exact.max_deviation > 0  # a whole-matrix row is not a one-row product
    bf16 = check_cache(example.BatchedPrefillModel(0, "bfloat16"), prompt, continuation=continuation, mode="control")
    assert bf16.logits_format == "bfloat16"  # an ml_dtypes bfloat16 array: kvfast knows the format


def _padded_at_multiples_of_8(example):
    """The example model whose recompute of 8, 16, ... tokens is a 64-row product (the tokens padded, the first
    rows kept): append-invariant at multiples of 8 on every CPU. The grid's run 2 showed the old statistic's blind
    spot through OpenBLAS's own kernels on one CPU (Intel, AVX-512) and not on another (AMD EPYC: 16 and 24 rows
    differ there); the padding makes the premise this test is about hold wherever it runs."""

    class Padded(example.BatchedPrefillModel):
        def recompute(self, tokens) -> np.ndarray:
            tokens = np.asarray(tokens)
            if len(tokens) % 8:
                return super().recompute(tokens)
            padded = np.concatenate([tokens, np.zeros(64 - len(tokens), tokens.dtype)])
            return super().recompute(padded)[: len(tokens)]

    return Padded


def test_the_old_statistic_fails_this_model(example, monkeypatch):
    """Run 2 of the grid (a prompt of 16 tokens, 32 steps: every prefix length the old statistic recomputed a
    multiple of 8) on a model append-invariant at multiples of 8: with the former statistic (prefix lengths as they
    come, no steps factor) nothing is measured and the verdict is ``inconclusive``; with the method: ``rounding``."""
    seed, prompt, continuation = list(example.grid(3))[2]
    assert (len(prompt), len(continuation)) == (16, 32)
    padded = _padded_at_multiples_of_8(example)
    report = check_cache(padded(seed), prompt, continuation=continuation, mode="control")
    assert report.verdict == "rounding"
    monkeypatch.setattr(C, "prefix_length", lambda q: q)
    monkeypatch.setattr(C, "steps_factor", lambda compared, draws: 1.0)
    old = check_cache(padded(seed), prompt, continuation=continuation, mode="control")
    assert old.verdict == "inconclusive" and old.path == "fast"
    assert old.scenarios["decode"].bounds.floor_source[1] == "float32 resolution (1 ulp)"  # nothing was measured


FIRST_STEP = {"posoff": {"decode": 1, "resume": 1}, "freeze": {"decode": 2, "resume": 2},
              "extend_from_zero": {"decode": None, "resume": 0}}  # fmt: skip


@pytest.mark.parametrize("bug", list(FIRST_STEP))
def test_each_cache_bug_of_the_same_model_is_found_where_it_first_acts(example, bug):
    """In float32 natively, over the first 6 runs of the grid (run 2 included): ``bug`` at the step where it
    first acts in every scenario it acts in, ``rounding`` in a scenario it never reaches."""
    assert set(FIRST_STEP) == set(example.BUGS)
    for seed, prompt, continuation in example.grid(6):
        report = check_cache(
            example.BatchedPrefillModel(seed, "float32", bug=bug), prompt, continuation=continuation, mode="control"
        )
        for name, step in FIRST_STEP[bug].items():
            s = report.scenarios[name]
            assert (s.verdict, s.first_bug_step) == (("rounding", None) if step is None else ("bug", step)), name
            if step is not None:
                assert set(s.step_verdicts[:step]) <= {"rounding"}, name


def test_the_example_prints_a_report(example, capsys):
    example.main(runs=2)
    out = capsys.readouterr().out
    assert "float32: 2 runs, decode: rounding 2, resume: rounding 2" in out
    assert "bfloat16: 2 runs, decode: rounding 2, resume: rounding 2" in out


# --- the statistics ------------------------------------------------------------------------------


def test_steps_factor_is_the_ratio_of_median_maxima():
    def median_max(n):
        return NormalDist().inv_cdf((1 + 2 ** (-1 / n)) / 2)

    assert C.steps_factor(65, 3) == median_max(65) / median_max(3)
    assert 2.0 < C.steps_factor(65, 3) < 2.1 and C.steps_factor(65, 1) > 3.7
    assert C.steps_factor(10, 10) == 1.0 and C.steps_factor(10, 200) == 1.0  # never below 1
    assert C.steps_factor(10, 0) == 1.0  # nothing measured: the bound is the format's resolution anyway
    assert C.steps_factor(64, 4) > C.steps_factor(32, 4) > C.steps_factor(32, 8)


def test_noise_draws_counts_nonzero_pairs_and_prefix_lengths_are_odd():
    sources = {"a": np.array([0.0, 1e-7, 0.0, 2e-7]), "b": np.array([3e-7, 0.0, 0.0, 0.0])}
    assert C.noise_draws(sources) == 3 and C.noise_draws({}) == 0
    assert [C.prefix_length(q) for q in (8, 9, 16, 24, 1)] == [9, 9, 17, 25, 1]


def test_judge_scales_the_pooled_noise_by_the_steps_factor():
    scale = np.array([2.0, 2.0, 4.0])
    dev = np.array([1e-6, 1e-5, 1.8e-5])
    f = C.steps_factor(40, 3)
    bound, ratio, verdicts, sources = C.judge(
        dev, scale, 1e-6, "batch shape at position 9", "float32", 4.0, 16.0, 40, 3
    )
    assert bound.tolist() == (f * 1e-6 * scale).tolist()
    assert ratio.tolist() == (dev / (f * 1e-6 * scale)).tolist()
    assert (
        sources[0] == f"order noise (batch shape at position 9, 1e-06 relative, x{f:.3g} for 40 rows against 3 draws)"
    )
    plain, _, old, _ = C.judge(dev, scale, 1e-6, "batch shape at position 9", "float32", 4.0, 16.0)
    assert plain.tolist() == (1e-6 * scale).tolist() and old == ("rounding", "inconclusive", "inconclusive")
    assert verdicts == ("rounding", "rounding", "rounding")
