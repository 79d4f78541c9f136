"""Lossy (quantized) caches (kvfast.check.lossy): the verdict ``lossy``, never ``exact`` nor ``rounding``.

kvfast's own int8 and fp8 caches measure exactly their format's expected error (they are its emulation:
ratio <= 1 at every step); an "int8" cache that stores 4 bits is ``bug`` at step 1; a logic bug under a
lossy cache is still found (the lossless twin is judged against the recompute). transformers' own fp8
``QuantizedCache`` is ``lossy`` on the tiny Llama, GPT-2 and Qwen2. kvfast's fp8 round trip equals
torch's float8 e4m3 conversion bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvfast import ModelConfig, init_params
from kvfast.bugs.lossy import inject_lossy_bug
from kvfast.check import check_cache
from kvfast.check.lossy import LOSSY_FORMATS, LossyKvfastModel, round_trip

CFG = ModelConfig(vocab=64, d_model=32, n_head=4, n_layer=2, d_ff=64, max_pos=64)
PROMPT = [1, 2, 3, 4, 5]
ALL = ("decode", "resume", "rollback", "fork")


def lossy(fmt: str = "int8", lossy_bug: str | None = None, **kwargs) -> LossyKvfastModel:
    return inject_lossy_bug(LossyKvfastModel(CFG, init_params(CFG, 0), "f64", fmt=fmt, **kwargs), lossy_bug)


def test_int8_round_trip_is_within_half_a_step():
    x = np.random.default_rng(0).standard_normal((50, 16)) * 3
    err = np.abs(round_trip("int8", x) - x).max(axis=1)
    assert (err <= np.abs(x).max(axis=1) * LOSSY_FORMATS["int8"][1] * (1 + 1e-12)).all()
    grid = np.arange(-127, 128, dtype=np.float64)[None, :] / 127 * 5  # on the int8 grid already: unchanged
    assert np.array_equal(round_trip("int8", grid), np.round(grid / (5 / 127)) * (5 / 127))


def test_fp8_round_trip_equals_torchs_float8_e4m3():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(1).standard_normal((40, 32)) * np.logspace(-3, 3, 40)[:, None]
    scale = np.abs(x).max(axis=1, keepdims=True) / 448.0
    want = torch.from_numpy(x / scale).to(torch.float8_e4m3fn).double().numpy() * scale
    assert np.array_equal(round_trip("fp8", x), want)


def test_fp8_tensor_takes_the_frozen_scale():
    x = np.array([[1.0, 0.001, 300.0]])
    # 0.001 rounds to the smallest subnormal, 2^-9; 300 to 288 (e4m3's spacing 32 there)
    assert np.array_equal(round_trip("fp8-tensor", x, 1.0), np.array([[1.0, 2.0**-9, 288.0]]))
    assert round_trip("fp8-tensor", np.array([[1000.0]]), 1.0)[0, 0] == 448.0  # saturates at the format's max
    with pytest.raises(ValueError, match="scale: None is not allowed for fmt 'fp8-tensor'"):
        round_trip("fp8-tensor", x)


def test_bad_formats_are_refused():
    with pytest.raises(ValueError, match="fmt: 'int9' is not allowed; allowed: int8, fp8, fp8-tensor"):
        round_trip("int9", np.zeros((1, 2)))
    with pytest.raises(ValueError, match="fmt: 'fp4' is not allowed; allowed: int8, fp8$"):
        lossy("fp4")
    with pytest.raises(ValueError, match="lossy_bug: 'x' is not allowed; allowed: int4"):
        lossy(lossy_bug="x")


@pytest.mark.parametrize("mode", ["exact", "control"])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_kvfasts_own_lossy_cache_is_lossy_never_exact_or_rounding(fmt, mode):
    report = check_cache(lossy(fmt), PROMPT, 16, mode=mode, scenarios=ALL)
    assert report.verdict == "lossy", report.format()
    assert report.passed == (mode == "control")  # exact mode promises ==, which no lossy cache keeps
    for s in report.scenarios.values():
        assert set(s.step_verdicts) == {"lossy"} and s.passed == (mode == "control")
        b = s.bounds  # measured IS the format's expected error
        assert (s.deviation == b.floor).all() and (b.ratio <= 1).all()
        assert s.deviation[1:].max() > 0
    assert "a lossy cache (" + fmt + ")" in report.format()


def test_a_cache_worse_than_its_format_is_a_bug_at_step_1():
    report = check_cache(lossy(lossy_bug="int4"), PROMPT, 16, mode="control", scenarios=("decode", "resume"))
    assert report.verdict == "bug" and report.scenarios["decode"].first_bug_step == 1, report.format()
    exact = check_cache(lossy(lossy_bug="int4"), PROMPT, 16, scenarios="decode", mode="exact")
    assert exact.verdict == "divergent"


def test_a_logic_bug_under_a_lossy_cache_is_still_found():
    model = LossyKvfastModel(CFG, init_params(CFG, 0), "f64", bug="posoff", fmt="int8")
    report = check_cache(model, PROMPT, 16, mode="control", scenarios="decode")
    assert report.verdict == "bug" and report.scenarios["decode"].first_bug_step == 1, report.format()


def test_a_lossy_cache_without_lossless_is_bad_input():
    from tests.toymodels import Toy

    class Declares(Toy):
        lossy_cache = "int8"

    with pytest.raises(ValueError, match=r"model\.lossy_cache: 'int8' declared without a lossless\(\) method"):
        check_cache(Declares(), [1, 2, 3], 4)


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_transformers_fp8_quantized_cache_is_lossy(family):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from kvfast.check.hf import HFModel
    from kvfast.testing import tiny_model

    torch.set_num_threads(1)
    model = tiny_model(family, "float32", "sdpa", 0)
    adapter = HFModel(model, new_cache=lambda: transformers.QuantizedCache("fp8", model.config))
    assert adapter.lossy_cache == "fp8-tensor" and HFModel(model).lossy_cache is None
    report = check_cache(adapter, list(range(3, 19)), 16, mode="control", scenarios=("decode", "resume", "fork"))
    assert report.verdict == "lossy", report.format()
    assert all(v == "lossy" for s in report.scenarios.values() for v in s.step_verdicts)
    assert report.scenarios["decode"].bounds.floor[1:].min() > 0  # the format's expected error was measured
    # transformers' fp8 cache is kvfast's per-tensor fp8 emulation up to its float32 scale (measured: ratio
    # 0.99-1.00005 on these models; kvfast divides in float64)
    assert report.max_ratio <= 1.001


def test_assert_cache_exact_fails_on_a_lossy_cache():
    from kvfast.check import assert_cache_exact

    with pytest.raises(AssertionError, match="FAIL: LOSSY"):
        assert_cache_exact(lossy(), PROMPT, 8, scenarios="decode")


#: transformers' group-wise backends on the tiny models (head_dim 8): groups of 8 (the default 64 divides
#: no tiny tensor: both backends refuse it) and a residual of 4 positions kept unquantized (default 128,
#: longer than the run: only the prefill would be quantized).
GROUPWISE = {
    "quanto": ("optimum.quanto", dict(nbits=4, q_group_size=8, residual_length=4)),
    "hqq": ("hqq", dict(nbits=4, q_group_size=8, residual_length=4)),
}


@pytest.mark.parametrize("backend", sorted(GROUPWISE))
def test_quanto_and_hqq_quantized_caches_are_lossy_never_rounding(backend, monkeypatch):
    """A 4-bit ``QuantizedCache`` of the quanto or HQQ backend (skipped where the package is absent: neither is
    a dependency of kvfast) is ``lossy`` at every step, its measured error against the cache unquantized
    within 4x kvfast's own int4 round trip's; a 2-bit cache judged against int8's expected error is ``bug``
    (failing data: a cache worse than the format it declares)."""
    module, kwargs = GROUPWISE[backend]
    pytest.importorskip(module)
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from kvfast.check.hf import HFModel
    from kvfast.testing import tiny_model

    torch.set_num_threads(1)
    model = tiny_model("llama", "float32", "sdpa", 0)
    adapter = HFModel(model, new_cache=lambda: transformers.QuantizedCache(backend, model.config, **kwargs))
    assert adapter.lossy_cache == "int4"
    scenarios = ("decode", "resume", "reorder", "padded")  # quanto's tensors cannot be deep-copied: no fork
    report = check_cache(adapter, list(range(3, 11)), 12, mode="control", scenarios=scenarios)
    assert report.verdict == "lossy" and report.passed, report.format()
    for s in report.scenarios.values():
        assert set(s.step_verdicts) == {"lossy"}, report.format()
        assert s.deviation[1:].min() > 0 and s.bounds.floor[1:].min() > 0  # measured and expected, at every step
    assert "a lossy cache (int4)" in report.format()

    two_bits = {**kwargs, "nbits": 2}
    adapter = HFModel(model, new_cache=lambda: transformers.QuantizedCache(backend, model.config, **two_bits))
    original = HFModel.lossy_cache.fget
    monkeypatch.setattr(HFModel, "lossy_cache", property(lambda a: "int8" if original(a) == "int2" else original(a)))
    worse = check_cache(adapter, list(range(3, 11)), 12, mode="control", scenarios="decode")
    assert worse.verdict == "bug" and worse.scenarios["decode"].first_bug_step == 1, worse.format()


# --- internal_formats or lossy_cache: a quantized cache is lossy_cache, never internal rounding -------------


def test_quantized_cache_entries_of_internal_formats():
    from kvfast.check.formats import quantized_cache

    internal = {"kv cache": "int8", "KV": "float8_e4m3", "cache_v": "float8_e5m2", "activations": "int8",
                "kv cache16": "float16", "kvfast": "int8"}  # fmt: skip
    assert quantized_cache(internal) == {"kv cache": "int8", "KV": "float8_e4m3", "cache_v": "float8_e5m2"}


def test_a_cache_declared_quantized_both_ways_is_refused():
    """lossy_cache and an int8 KV cache in internal_formats: one model, two contradicting declarations."""

    class Both(LossyKvfastModel):
        internal_formats = {"kv cache": "int8"}

    with pytest.raises(ValueError, match=r"model\.internal_formats: \{'kv cache': 'int8'\} declares the cache"):
        check_cache(Both(CFG, init_params(CFG, 0), "f64", fmt="int8"), PROMPT, 4, mode="control")

    class Float16Cache(LossyKvfastModel):  # failing data: a float16 cache is rounding, no contradiction
        internal_formats = {"kv cache": "float16"}

    assert check_cache(
        Float16Cache(CFG, init_params(CFG, 0), "f64", fmt="int8"), PROMPT, 4, mode="control"
    ).verdict == ("lossy")


def test_an_int8_cache_declared_as_an_internal_format_gets_a_note():
    """Declared as internal rounding, a quantized cache is judged as order noise: the report says why that can
    pass a cache worse than its format, and what to declare instead; an int8 activation gets no such note."""
    from tests.toymodels import LowFormatToy

    model = LowFormatToy("kv16")
    model.internal_formats = {"kv cache": "int8"}
    report = check_cache(model, [1, 2, 3, 4], 4, mode="control", scenarios="decode")
    notes = [n for n in report.notes if n.startswith("internal_formats puts the KV cache in int8")]
    assert len(notes) == 1 and "lossy_cache = 'int8' with lossless()" in notes[0], report.format()
    activations = check_cache(LowFormatToy("int8"), [1, 2, 3, 4], 4, mode="control", scenarios="decode")
    assert not any("puts the KV cache" in n for n in activations.notes)
    exact = check_cache(model, [1, 2, 3, 4], 4, scenarios="decode", mode="exact")  # judged with ==: no noise, no note
    assert not any("puts the KV cache" in n for n in exact.notes)
