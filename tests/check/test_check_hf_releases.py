"""Every transformers release kvfast declares, on whichever one is installed: clean tiny models (Llama,
GPT-2, Mistral with its sliding window, Llama over a ``StaticCache``; Mamba, Mamba-2) in every scenario get no
``bug`` in control mode (float32, sdpa) and no ``divergent`` in exact mode where the recompute is bit-exact
(bfloat16, eager; the attention models);
a scenario the release cannot run is ``skipped`` with a note naming the release and the reason.

Run on the lowest release (``python3 dev.py test-lowest-hf``, in CI) and on the newest (``python3 dev.py
test``); ``benchmarks/scan_releases.py`` runs the same models on 4.57, 5.0, 5.10, 5.15, 5.24 and 5.25
(docs/check.md, "Transformers releases"). About 40 s on one core.

The crop: before 5.14 ``cache.crop(m)`` keeps ``m`` positions for ``m >= 0`` (``crop(0)`` empties the
cache), from 5.14 on ``crop(0)`` removes nothing; ``crop(-r)`` removes ``r`` in both
(:func:`kvfast.check.hf_path.crop_argument`).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

if os.environ.get("KVFAST_REQUIRE_HF") == "1":  # CI (.ci/run): run these, never skip them
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

from packaging.version import Version  # noqa: E402 (a dependency of transformers)

from kvfast.check import check_cache, hf_path  # noqa: E402
from kvfast.check.hf import HFModel  # noqa: E402
from kvfast.check.options import ALL_SCENARIOS  # noqa: E402
from kvfast.check.protocol import ModelUnderTestError  # noqa: E402
from kvfast.testing import MISTRAL_WINDOW, tiny_model  # noqa: E402

RELEASE = Version(transformers.__version__)
PROMPT = list(range(3, 3 + MISTRAL_WINDOW + 4))  # longer than Mistral's window
#: shorter than a tiny Mamba's conv kernel of 4 once split for the resume (a state cache prefilled with fewer
#: positions than generate numbers its prefill: kvfast.check.hf.HFModel.cache_positions)
SHORT_PROMPT = [5, 9, 2, 7, 4]
STEPS = 10
#: (family, cache): the models every release must check cleanly
MODELS = [("llama", "dynamic"), ("gpt2", "dynamic"), ("mistral", "dynamic"), ("llama", "static")]


def adapter(family: str, cache: str, dtype: str, attention: str) -> HFModel:
    model = tiny_model(family, dtype, attention)
    if cache == "static":
        return HFModel(model, new_cache=lambda: transformers.StaticCache(config=model.config, max_cache_len=64))
    return HFModel(model)


def declares_croppable(model, prompt) -> bool:
    """Whether the installed release declares the model's prefilled cache croppable (``Cache.is_croppable``, from
    5.24 on): its rollback must then run, never be skipped (5.25: static caches, Mamba and Mamba-2 too)."""
    hf = model if isinstance(model, HFModel) else HFModel(model)
    hf.prefill(prompt)
    return getattr(hf.cache, "is_croppable", False) is True


def _assert_ran_or_skipped_with_reason(report, allowed: tuple[str, ...], croppable: bool = False) -> None:
    for name, scenario in report.scenarios.items():
        if scenario.verdict == "skipped":
            assert not (croppable and name == "rollback"), report.format()
            assert scenario.notes, report.format()
            assert f"transformers {transformers.__version__}" in scenario.notes[0], (name, scenario.notes)
        else:
            assert scenario.verdict in allowed, report.format()


@pytest.mark.parametrize("scenario", ALL_SCENARIOS)
@pytest.mark.parametrize(("family", "cache"), MODELS)
def test_control_mode_finds_no_bug_in_a_clean_model(family, cache, scenario):
    model = adapter(family, cache, "float32", "sdpa")
    croppable = declares_croppable(model, PROMPT)
    report = check_cache(model, PROMPT, STEPS, mode="control", scenarios=scenario)
    _assert_ran_or_skipped_with_reason(report, ("rounding",), croppable)


@pytest.mark.parametrize("scenario", ALL_SCENARIOS)
@pytest.mark.parametrize(("family", "cache"), MODELS)
def test_exact_mode_finds_a_bit_exact_model_exact(family, cache, scenario):
    """bfloat16 eager attention: cache and recompute agree bit for bit (docs/check.md), in every release."""
    model = adapter(family, cache, "bfloat16", "eager")
    croppable = declares_croppable(model, PROMPT)
    report = check_cache(model, PROMPT, STEPS, mode="exact", scenarios=scenario)
    _assert_ran_or_skipped_with_reason(report, ("exact",), croppable)


@pytest.mark.parametrize("prompt", [PROMPT, SHORT_PROMPT], ids=["long", "short"])
@pytest.mark.parametrize("scenario", ALL_SCENARIOS)
@pytest.mark.parametrize("architecture", ["mamba", "mamba2"])
def test_a_state_space_model_is_checked_on_every_release(architecture, scenario, prompt):
    """Mamba and Mamba-2 take their cache as ``cache_params`` before 5.x moved them to ``cache``: checked either way
    (a short prompt too: its resume is prefilled with fewer positions than the conv kernel),
    with no ``bug``; a state cache the release cannot crop or reorder skips that scenario with a note. (Where
    ``generate`` continues a Mamba cache by a chunk, the chunk restarts its state: a finding, docs/check.md.)"""
    from kvfast.studies.architectures import tiny_architecture

    model = tiny_architecture(architecture, "float32", "auto", 0)
    if scenario == "resume" and architecture == "mamba" and HFModel(model).cache_arg != "cache_params":
        pytest.skip("Mamba's multi-token continuation restarts its state: a real finding (docs/check.md)")
    croppable = declares_croppable(model, prompt)
    report = check_cache(model, prompt, STEPS, mode="control", scenarios=scenario)
    _assert_ran_or_skipped_with_reason(report, ("rounding",), croppable)


def test_crop_zero_is_asked_of_the_release():
    """The installed release says what ``crop(0)`` does; its answer is the one its sources give (5.14)."""
    assert hf_path.crop_zero_removes_nothing() is (RELEASE >= Version("5.14"))
    assert hf_path.crop_argument(None, 3) == -3
    assert hf_path.crop_argument(None, 0) == (0 if RELEASE >= Version("5.14") else None)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_rollback_of_nothing_keeps_every_position(family):
    """``crop(T)`` right after a prefill of ``T`` (the rollback scenario's first call) keeps the cache as it is;
    ``crop(T - 2)`` then keeps ``T - 2``. Before 5.14, ``cache.crop(0)`` emptied it (clean Llama ``bug``)."""
    hf = adapter(family, "dynamic", "float32", "sdpa")
    hf.prefill(PROMPT)
    hf.crop(len(PROMPT))
    assert hf.cache.get_seq_length() == len(PROMPT)
    hf.crop(len(PROMPT) - 2)
    assert hf.cache.get_seq_length() == len(PROMPT) - 2 == hf.length


def test_a_release_that_cannot_crop_refuses_before_changing_the_cache():
    """A sliding-window layer past its window that has not recorded its past cannot give back what it dropped,
    in any release: the crop raises ``NotImplementedError`` naming the release, and the cache is untouched."""
    hf = adapter("mistral", "dynamic", "float32", "sdpa")
    hf.prefill(PROMPT)
    before = [layer.keys.clone() for layer in hf.cache.layers]
    with pytest.raises(NotImplementedError, match=rf"transformers {transformers.__version__}: .*window of 12"):
        hf.crop(len(PROMPT) - 1)
    assert hf.length == len(PROMPT)
    for layer, keys in zip(hf.cache.layers, before, strict=True):
        assert torch.equal(layer.keys, keys)
        assert getattr(layer, "record_past", False) is False


def test_a_cache_without_reorder_is_skipped_with_the_release_named():
    hf = adapter("llama", "dynamic", "float32", "sdpa")

    class NoReorder:  # a cache type with no reorder_cache()
        layers = ()

    hf.cache = NoReorder()
    with pytest.raises(NotImplementedError, match=rf"transformers {transformers.__version__}: NoReorder has no"):
        hf.reorder(np.array([1, 0]))


class RefusingCache(transformers.DynamicCache):
    """A release that refuses to roll back or reorder: its own call raises."""

    def crop(self, tokens_to_remove):
        raise RuntimeError("this release cannot crop\nsecond line")

    def reorder_cache(self, beam_idx):
        raise RuntimeError("this release cannot reorder")


class BreakingCache(transformers.DynamicCache):
    """A release that accepts a rollback and leaves the cache broken: the next forward raises."""

    def crop(self, tokens_to_remove):
        super().crop(tokens_to_remove)
        if tokens_to_remove:
            for layer in self.layers:
                layer.keys = layer.keys[..., :1]  # a head dimension of 1: the next update cannot concatenate


def _llama_over(cache_class) -> HFModel:
    return HFModel(tiny_model("llama", "float32", "sdpa"), new_cache=cache_class)


def test_an_operation_the_release_refuses_is_skipped_naming_the_release_and_the_refusal():
    report = check_cache(_llama_over(RefusingCache), PROMPT, STEPS, mode="control", scenarios=["rollback", "reorder"])
    for name, call in (("rollback", "crop(0)" if hf_path.crop_argument(None, 0) == 0 else "crop(-1)"),
                       ("reorder", "reorder_cache()")):  # fmt: skip
        scenario = report.scenarios[name]
        assert scenario.verdict == "skipped", report.format()
        want = f"transformers {transformers.__version__} refuses RefusingCache.{call}: RuntimeError: this release"
        assert want in scenario.notes[0] and "second line" not in scenario.notes[0], scenario.notes
    control = check_cache(_llama_over(transformers.DynamicCache), PROMPT, STEPS, mode="control",
                          scenarios=["rollback", "reorder"])  # fmt: skip
    assert {s.verdict for s in control.scenarios.values()} == {"rounding"}, control.format()


def test_a_rollback_the_release_accepts_and_then_breaks_is_the_models_failure():
    with pytest.raises(ModelUnderTestError, match=r"model\.decode\(\d+\) raised RuntimeError") as failed:
        check_cache(_llama_over(BreakingCache), PROMPT, STEPS, mode="control", scenarios="rollback")
    assert "transformers" not in str(failed.value).split(" raised ")[0]
