"""Issue 18 rule 2: a recompute that changes with the sequence's length is its own verdict, ``length-dependent``.

A toy whose recompute scales every position by the total length (as dynamic NTK and LongRoPE do) must never
get ``rounding`` (before: control mode took the prefix recomputes' logical difference as order noise and said
``rounding``); a clean model, append-invariant or only rounding away from it, is never called so.
"""

from __future__ import annotations

import numpy as np
import pytest
from toymodels import Toy

import kvfast
from kvfast.check import formats as F
from kvfast.check.reference import length_dependence

PROMPT = [1, 2, 3, 4, 5, 6]


class LengthScaledToy(Toy):
    """The recompute scales every position's term by the total length past 8 tokens (like dynamic NTK); the
    cache keeps each row as computed at its own length: a cache that is right for what it stores."""

    def __init__(self, strength=0.01, bug=None):
        super().__init__(bug)
        self.strength = strength

    def _pos(self, p, n):
        return self.P[p] * (1 + self.strength * max(0, n - 8))

    def recompute(self, tokens):
        s, out = np.zeros(7), []
        for p, t in enumerate(tokens):
            s = s + self.E[t]
            out.append(np.tanh(s) + self._pos(p, len(tokens)))
        return np.array(out)

    def prefill(self, tokens):
        out = self.recompute(tokens)
        Toy.prefill(self, tokens)
        return out

    def decode(self, token):
        self.s = self.s + self.E[token]
        self.n += 1
        return np.tanh(self.s) + self._pos(self.n - 1, self.n)


class RoundedPrefixToy(Toy):
    """A clean model whose recompute is append-invariant only to rounding: rows of a longer batch carry a
    relative error of a few float32 units (as a GEMM's blocking changes with the batch)."""

    def recompute(self, tokens):
        out = super().recompute(tokens)
        wobble = 1 + 2 * np.finfo(np.float32).eps * np.sin(np.arange(out.size) * len(tokens)).reshape(out.shape)
        return out * wobble


@pytest.mark.parametrize("mode", ["exact", "control"])
@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("scenarios", [("decode", "resume"), ("resume",)])
def test_a_length_dependent_recompute_is_named_and_never_passes(mode, fast, scenarios):
    report = kvfast.check_cache(LengthScaledToy(), PROMPT, 10, mode=mode, fast=fast, scenarios=scenarios)
    assert report.verdict == "length-dependent"
    assert not report.passed
    found = report.length_dependence
    assert found is not None and found.ratio > 1 and found.short < found.long == 16
    lines = report.format().splitlines()
    assert lines[0].startswith("kvfast check: FAIL: LENGTH-DEPENDENT (")
    assert lines[1].startswith("the recompute depends on the sequence's length: row ")
    assert f"recompute(first {found.long} tokens)" in lines[1] and "dynamic NTK" in lines[1]


def test_control_mode_no_longer_takes_the_length_dependence_for_order_noise():
    """The batch-shape source that carried the logical difference is not admitted: the scenarios say bug."""
    report = kvfast.check_cache(LengthScaledToy(), PROMPT, 10, mode="control")
    assert {s.verdict for s in report.scenarios.values()} == {"bug"}
    assert any("not admitted as order noise" in n for n in report.notes)


def test_a_promoted_check_passes_its_finding_up():
    class Promotable(LengthScaledToy):
        def promote(self, dtype):
            return LengthScaledToy()

    report = kvfast.check_cache(Promotable(), PROMPT, 10, mode="control", promote="float64")
    assert report.promoted.verdict == "length-dependent"
    assert report.verdict == "length-dependent" and not report.passed


@pytest.mark.parametrize("model", [Toy(), RoundedPrefixToy()], ids=["invariant", "rounded"])
@pytest.mark.parametrize("mode", ["exact", "control"])
@pytest.mark.parametrize("fast", [True, False])
def test_a_clean_model_is_never_called_length_dependent(model, mode, fast):
    report = kvfast.check_cache(model, PROMPT, 10, mode=mode, fast=fast)
    assert report.length_dependence is None
    assert report.verdict != "length-dependent"
    if mode == "control":
        assert report.verdict == "rounding", report.format()


def test_the_ceiling_sits_between_rounding_and_a_logical_difference():
    full = np.ones((4, 3))
    ceiling = float(F.length_ceiling("float32", 1.0))
    assert length_dependence({3: full[:3] + 0.5 * ceiling}, full, "float32") is None
    found = length_dependence({3: full[:3] + 2 * ceiling}, full, "float32")
    assert found is not None and found.short == 3 and found.long == 4 and found.ratio == pytest.approx(2)
    # float64 logits: a float32 softmax inside may be rounding; float32's ceiling applies
    assert float(F.length_ceiling("float64", 1.0)) == ceiling


@pytest.mark.subprocess
def test_kvfast_check_exits_6_with_the_line(tmp_path):
    import inspect
    import os
    import subprocess
    import sys
    from pathlib import Path

    import toymodels

    (tmp_path / "toymodels.py").write_text(Path(toymodels.__file__).read_text())
    source = inspect.getsource(LengthScaledToy)
    (tmp_path / "scaled.py").write_text(f"import numpy as np\nfrom toymodels import Toy\n\n{source}\n")
    root = Path(kvfast.__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "kvfast.cli", "check", "scaled:LengthScaledToy", "--prompt", "1,2,3,4,5,6"]
    out = subprocess.run(
        [*cmd, "--steps", "10", "--mode", "control"], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(root)),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 6, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("kvfast check: FAIL: LENGTH-DEPENDENT (")
    assert lines[1].startswith("the recompute depends on the sequence's length: row ")


def test_max_ratio_is_none_on_an_exact_mode_report():
    report = kvfast.check_cache(Toy(), PROMPT, 4)
    assert report.max_ratio is None
    assert kvfast.check_cache(Toy(), PROMPT, 4, mode="control").max_ratio == 0.0
