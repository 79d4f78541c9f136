"""The default mode, ``auto``, on the models a new user brings (issue 41): a correct model passes (``exact`` where
every step is bit-equal, else ``rounding``) and a bugged one fails with ``BUG`` on line 1, naming the scenario and
the step where the bug first acts, through ``check_cache``, the ``kv_check`` fixture and ``kvfast check``.

The hand-written decoder (tests/ropedecoder.py: RoPE, a cache of tensors, a batched prefill) is off by a few units
in the last place between prefill and decode, so exact mode fails it whether clean or bugged; its first line then
says that such a divergence is the size of order noise, and names the mode that tells rounding from bugs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

if os.environ.get("KVFAST_REQUIRE_HF") == "1":  # CI (.ci/run): run these, never skip them
    import torch
else:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")

import ropedecoder  # noqa: E402
from shared import TESTS  # noqa: E402

from kvfast.bugs.hf import first_acting_step, inject_hf_bug  # noqa: E402
from kvfast.check import check_cache  # noqa: E402
from kvfast.check.hf import HFModel  # noqa: E402
from kvfast.testing import tiny_model  # noqa: E402

PROMPT = [5, 17, 3, 40, 22, 9]
STEPS = 10
#: (factory, the first line's start): the clean decoder passes, each bug fails where it first acts
DECODERS = {
    "clean": "kvfast check: PASS: ROUNDING",
    "clean64": "kvfast check: PASS: ROUNDING",
    "frozen": "kvfast check: FAIL: BUG in scenario 'resume' at step 1 (position 6)",  # the first decode after extend
    "window": "kvfast check: FAIL: BUG in scenario 'decode' at step 4 (position 9)",  # the 9th position, 8 kept
}


@pytest.mark.parametrize("name", list(DECODERS))
def test_a_hand_written_decoder_is_judged_right_by_default(name):
    report = check_cache(getattr(ropedecoder, name)(), PROMPT, STEPS)
    assert report.format().splitlines()[0] == DECODERS[name], report.format()
    assert report.passed is name.startswith("clean")
    assert report.judged == "control" and report.mode == "auto"  # batched prefill vs one-row decode: not bit-equal
    exact = check_cache(getattr(ropedecoder, name)(), PROMPT, STEPS, mode="exact")  # the control: == fails them all
    first = exact.format().splitlines()[0]
    assert not exact.passed and "units in the last place of its" in first and "tells rounding from bugs" in first
    assert ("far beyond it" in first) is (not name.startswith("clean"))


@pytest.mark.subprocess
@pytest.mark.parametrize("name", list(DECODERS))
def test_the_kv_check_fixture_and_kvfast_check_say_the_same(kv_check, name):
    if name.startswith("clean"):
        assert kv_check(getattr(ropedecoder, name)(), PROMPT, STEPS).verdict == "rounding"
    else:
        with pytest.raises(pytest.fail.Exception) as failed:
            kv_check(getattr(ropedecoder, name)(), PROMPT, STEPS)
        assert str(failed.value).splitlines()[0] == DECODERS[name]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    args = [f"ropedecoder:{name}", "--prompt", ",".join(map(str, PROMPT)), "--steps", str(STEPS)]
    cli = [sys.executable, "-m", "kvfast.cli", "check", *args]
    done = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=300)
    assert done.stdout.splitlines()[0] == DECODERS[name], done.stdout + done.stderr
    assert done.returncode == (0 if name.startswith("clean") else 1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hugging_face_models_pass_clean_and_fail_bugged_by_default(family, dtype):
    model = tiny_model(family, dtype, "sdpa", 0)
    clean = check_cache(model, PROMPT, STEPS)
    assert clean.passed and clean.verdict in ("exact", "rounding"), clean.format()
    assert clean.format().startswith(f"kvfast check: PASS: {clean.verdict.upper()}\n")
    promote = "float64" if dtype == "bfloat16" else None  # bfloat16 logits cannot resolve it: the logic check can
    bugged = check_cache(inject_hf_bug(HFModel(model), "posoff"), PROMPT, STEPS, scenarios="decode", promote=promote)
    want = first_acting_step("posoff", "decode", len(PROMPT))
    assert bugged.verdict == "bug" and bugged.decider().worst.first_bug_step == want, bugged.format()
    assert bugged.format().startswith(f"kvfast check: FAIL: BUG in scenario 'decode' at step {want} ")


def test_a_bug_only_the_logic_check_finds_decides_the_verdict_and_line_1():
    """bfloat16 logits cannot resolve ``posoff`` on this model natively; the float64 logic check can: its ``bug``
    is the report's verdict (the native one beside it) and its first line, never ``rounding`` with ``passed``
    False."""
    model = inject_hf_bug(HFModel(tiny_model("llama", "bfloat16", "sdpa", 0)), "posoff")
    report = check_cache(model, PROMPT, STEPS, mode="control", promote="float64", scenarios="decode")
    assert report.promoted.verdict == "bug" and report.verdict == "bug" and not report.passed
    first = report.format().splitlines()[0]
    want = first_acting_step("posoff", "decode", len(PROMPT))
    assert first.startswith(f"kvfast check: FAIL: BUG in scenario 'decode' at step {want} "), first
    if report.native_verdict != "bug":  # the native verdict is named beside the logic check's
        assert first.endswith(f"(float64 logic check); native bfloat16: {report.native_verdict.upper()}")
    clean = check_cache(tiny_model("llama", "bfloat16", "sdpa", 0), PROMPT, STEPS, promote="float64")
    assert clean.passed and clean.verdict in ("exact", "rounding") and clean.native is None


class CountingExact(ropedecoder.RopeDecoder):
    """Bit-exact (every path runs one token at a time, as decode does) and counting its order-noise variants."""

    variant_calls = 0

    def _stepwise(self, tokens):
        saved = self.cache, self.pos
        logits, self.cache = self._forward([tokens[0]], None)
        self.pos = 1
        rows = torch.stack([logits[0], *(self.decode(t) for t in tokens[1:])])
        done, (self.cache, self.pos) = (rows, self.cache, self.pos), saved
        return done

    def recompute(self, tokens):
        return self._stepwise(list(tokens))[0]

    def prefill(self, tokens):
        rows, self.cache, self.pos = self._stepwise(list(tokens))
        return rows

    def extend(self, tokens):
        return torch.stack([self.decode(t) for t in tokens])

    def recompute_variants(self, tokens):
        type(self).variant_calls += 1
        return {"again": self.recompute(tokens)}


def test_auto_measures_no_noise_on_a_bit_exact_model():
    """A bit-exact model costs what exact mode costs: its order-noise variants are never run (control mode runs
    them: the control)."""
    CountingExact.variant_calls = 0
    report = check_cache(CountingExact(), PROMPT, 6)
    assert report.verdict == "exact" and report.judged == "exact" and CountingExact.variant_calls == 0
    assert report.format().startswith("kvfast check: PASS: EXACT\nevery compared step equals the recompute")
    check_cache(CountingExact(), PROMPT, 6, mode="control")
    assert CountingExact.variant_calls == 1
