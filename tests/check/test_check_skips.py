"""Issue 18 rule 6: every architecture that runs is checked. Variants a model cannot build or run and a logic
check it cannot run in are skipped with a note naming them and the reason, never a crash and never the loss of
the native verdict; a resume-only check prefills only the first chunk."""

from __future__ import annotations

import numpy as np
import pytest
from toymodels import Toy

import kvfast

PROMPT = [1, 2, 3, 4, 5, 6]


class BrokenVariants(Toy):
    def recompute_variants(self, tokens):
        raise RuntimeError("no second kernel here")


class OneVariantSkipped(Toy):
    skipped_variants = {"attention": "eager-only"}

    def recompute_variants(self, tokens):
        return {"batch": Toy.recompute(self, tokens)}


class CannotPromote(Toy):
    def promote(self, dtype):
        raise TypeError(f"expected Float but got {dtype}")


class FailsPromoted(Toy):
    def promote(self, dtype):
        class Fails(Toy):
            def decode(self, token):
                raise RuntimeError("no float64 kernel for the experts")

        return Fails()


def test_a_variant_hook_that_raises_is_skipped_with_its_line():
    report = kvfast.check_cache(BrokenVariants(), PROMPT, 8, mode="control")
    assert report.verdict == "rounding"
    assert (
        "order-noise variant 'all' skipped: model.recompute_variants(<14 tokens>) raised RuntimeError: "
        "no second kernel here" in report.notes
    )


def test_a_variant_the_model_could_not_build_is_named():
    report = kvfast.check_cache(OneVariantSkipped(), PROMPT, 8, mode="control")
    assert report.verdict == "rounding"
    assert "order-noise variant 'attention' skipped: eager-only" in report.notes
    assert any("variant 'batch'" in n for n in report.notes)


def test_a_logic_check_the_model_cannot_run_keeps_the_native_verdict():
    report = kvfast.check_cache(FailsPromoted(), PROMPT, 8, mode="control", promote="float64")
    assert report.promoted is None and report.verdict == "rounding" and report.passed
    skipped = [n for n in report.notes if n.startswith("the logic check in float64 was skipped")]
    assert len(skipped) == 1, report.notes
    assert "model.decode(" in skipped[0] and "RuntimeError: no float64 kernel for the experts" in skipped[0]


def test_promote_itself_raising_is_the_models_failure():
    with pytest.raises(kvfast.ModelUnderTestError, match=r"model\.promote\('float64'\) raised TypeError"):
        kvfast.check_cache(CannotPromote(), PROMPT, 8, mode="control", promote="float64")


def test_a_skipped_logic_check_does_not_hide_the_native_bug():
    class Bugged(FailsPromoted):
        def __init__(self):
            super().__init__("posfrozen")

    report = kvfast.check_cache(Bugged(), PROMPT, 8, mode="control", promote="float64")
    assert report.verdict == "bug" and not report.passed


class ShortPrefill(Toy):
    """Prefills at most 3 tokens (a model that cannot take the whole prompt at once); extends the rest."""

    def prefill(self, tokens):
        if len(tokens) > 3:
            raise RuntimeError(f"prefill of {len(tokens)} tokens: at most 3")
        return super().prefill(tokens)

    def extend(self, tokens):
        return np.array([Toy.decode(self, int(t)) for t in tokens])


@pytest.mark.parametrize("mode", ["exact", "control"])
def test_a_resume_only_check_prefills_only_the_first_chunk(mode):
    report = kvfast.check_cache(ShortPrefill(), PROMPT, 8, mode=mode, scenarios="resume", split=3)
    assert report.verdict in ("exact", "rounding") and report.path == "fast"
    with pytest.raises(kvfast.ModelUnderTestError, match=r"model\.prefill\(<6 tokens>\) raised RuntimeError"):
        kvfast.check_cache(ShortPrefill(), PROMPT, 8, mode=mode)  # the decode scenario needs the whole prompt


def test_the_logic_check_names_the_format_it_actually_ran_in():
    class Float32Logits(Toy):
        def recompute(self, tokens):
            return super().recompute(tokens).astype(np.float32)

        def prefill(self, tokens):
            return super().prefill(tokens).astype(np.float32)

        def decode(self, token):
            return super().decode(token).astype(np.float32)

    class PromotesToFloat32(Toy):
        def promote(self, dtype):
            return Float32Logits()

    report = kvfast.check_cache(PromotesToFloat32(), PROMPT, 6, mode="control", promote="float64")
    assert report.promoted.logits_format == "float32"
    assert "logic check in float32 (same tokens): ROUNDING" in report.format()
    assert "logic check in float64" not in report.format()
    assert any("the logic check ran in float32" in n for n in report.notes)
