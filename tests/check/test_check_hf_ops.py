"""The rollback and fork scenarios on tiny random Hugging Face models (hf_path's cache operations), no downloads.

Clean models are never ``bug`` nor ``inconclusive`` in control mode (float32 and bfloat16, the float64
logic check included; the whole matrix of 4 families x 2 dtypes x 2 seeds x 2 prompts is ``-m slow``,
about 40 s). Mistral rolls back past its sliding window (its cache records its past, as ``generate``
makes it do); a static sliding-window cache larger than the window cannot roll back and is skipped with
a note. ``crop_short`` is found at step 1 of the rollback; ``fork_shared_keys`` at the first step after
the restore where the cache writes keys in place (a ``StaticCache``), and nowhere with a ``DynamicCache``,
which concatenates new tensors.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("KVFAST_REQUIRE_HF") == "1":  # CI (.ci/run): run these, never skip them
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

from kvfast.bugs.hf import inject_hf_bug  # noqa: E402
from kvfast.bugs.operations import OP_BUGS, WINDOW_BUG, inject_op_bug, op_first_acting_step  # noqa: E402
from kvfast.check import check_cache  # noqa: E402
from kvfast.check.hf import HFModel  # noqa: E402
from kvfast.check.scenarios import BRANCH  # noqa: E402
from kvfast.studies.hf_common import prompt_and_continuation  # noqa: E402
from kvfast.studies.hf_matrix import PROMPT_LENGTHS, PROMPT_STREAM  # noqa: E402
from kvfast.testing import MISTRAL_WINDOW, tiny_model  # noqa: E402

STEPS = 16
OPS = ("rollback", "fork", "reorder", "padded")
CASES = [
    (seed, k, *prompt_and_continuation(PROMPT_STREAM, seed, k, STEPS, PROMPT_LENGTHS))
    for seed in range(2)
    for k in range(2)
]
LONG_PROMPT = list(range(3, 3 + MISTRAL_WINDOW + 4))  # longer than Mistral's window
#: Whether the installed release can crop a StaticCache (its StaticLayer has crop() from transformers 5.24 on);
#: before, the rollback of a static cache is skipped with a note (tests/check/test_check_hf_releases.py)
STATIC_CROPS = callable(getattr(transformers.cache_utils.StaticLayer, "crop", None))
NO_STATIC_CROP = "this transformers release's StaticLayer has no crop(): a static rollback is skipped (5.24 on: runs)"
#: Whether the installed release offers past recording (5.15 on), which lets a sliding-window layer roll back past
#: its window; before, that rollback is skipped with a note (tests/check/test_check_hf_releases.py)
RECORDS_PAST = callable(
    getattr(getattr(transformers.cache_utils, "DynamicSlidingWindowLayer", None), "activate_past_recording", None)
)
NO_RECORDING = "this transformers release has no past recording: a rollback past the window is skipped"


def static(model, length: int = 64):
    return lambda: transformers.StaticCache(config=model.config, max_cache_len=length)


def _assert_clean(report) -> None:
    for checked in (report, report.promoted):
        assert checked.verdict == "rounding", report.format()
        assert set(checked.scenarios) == {*OPS, BRANCH, "reorder-beam", "padded-row"}


def test_a_clean_llama_through_rollback_and_fork():
    seed, _, prompt, continuation = CASES[0]
    report = check_cache(
        tiny_model("llama", "float32", "sdpa", seed), prompt, mode="control", continuation=continuation,
        scenarios=OPS, promote="float64",
    )  # fmt: skip
    _assert_clean(report)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "mistral", "qwen2"])
def test_clean_models_are_never_a_bug_nor_inconclusive(family, dtype):
    for seed, _, prompt, continuation in CASES:
        model = tiny_model(family, dtype, "sdpa", seed)
        report = check_cache(model, prompt, mode="control", continuation=continuation, scenarios=OPS, promote="float64")
        _assert_clean(report)


@pytest.mark.skipif(not RECORDS_PAST, reason=NO_RECORDING)
def test_mistral_rolls_back_past_its_window():
    model = tiny_model("mistral", "float32", "sdpa", 0)
    report = check_cache(model, LONG_PROMPT, 12, mode="control", scenarios=OPS)
    assert report.verdict == "rounding", report.format()
    assert report.scenarios["rollback"].verdict == "rounding"
    bad = check_cache(inject_op_bug(HFModel(model), "crop_short"), LONG_PROMPT, 12, mode="control", scenarios=OPS)
    assert bad.scenarios["rollback"].first_bug_step == 1, bad.format()


def test_reorder_validates_its_beams():
    adapter = HFModel(tiny_model("llama", "float32", "sdpa", 0))
    with pytest.raises(ValueError, match="cache: no beams"):
        adapter.decode_beams([1, 2])
    adapter.prefill_beams([1, 2, 3], 2)
    with pytest.raises(ValueError, match=r"tokens: 3 tokens are not allowed; allowed: one per beam \(2\)"):
        adapter.decode_beams([1, 2, 3])


def test_a_static_window_cache_that_cannot_roll_back_is_skipped():
    model = tiny_model("mistral", "float32", "sdpa", 0)
    report = check_cache(HFModel(model, new_cache=static(model)), LONG_PROMPT, 8, mode="control", scenarios=OPS)
    rollback = report.scenarios["rollback"]
    assert rollback.verdict == "skipped", report.format()
    assert "not croppable" in rollback.notes[0] or "layers have no crop()" in rollback.notes[0], report.format()
    assert report.scenarios["fork"].verdict == "rounding" and report.passed


@pytest.mark.parametrize(
    "bug", [b for b in OP_BUGS if b not in ("padded_positions_from_start", "static_never_cleared", WINDOW_BUG)]
)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_operation_bugs_are_found_where_they_first_act(family, bug):
    if bug == "crop_short" and not STATIC_CROPS:
        pytest.skip(NO_STATIC_CROP)
    seed, _, prompt, continuation = CASES[1]
    model = tiny_model(family, "float32", "sdpa", seed)
    adapter = inject_op_bug(HFModel(model, new_cache=static(model)), bug)
    report = check_cache(adapter, prompt, mode="control", continuation=continuation, scenarios=OPS)
    for name in OPS:
        assert report.scenarios[name].first_bug_step == op_first_acting_step(bug, name, STEPS), report.format()
    for name, s in report.scenarios.items():
        if name not in OPS:  # the second branch or beam: the reorder bugs act in both beams
            assert s.first_bug_step == op_first_acting_step(bug, name, STEPS), report.format()


def test_left_padding_positions_from_the_padded_start():
    """Found at step 0 of the padded row on GPT-2 (absolute positions); invisible under rotary positions
    (Llama), which see only the differences of positions: the shift is one constant per row."""
    seed, _, prompt, continuation = CASES[1]
    prompt = list(range(3, 19))  # 16 tokens: the other row has 14 and two pads
    for family, want in (("gpt2", 0), ("llama", None)):
        adapter = inject_op_bug(HFModel(tiny_model(family, "float32", "sdpa", seed)), "padded_positions_from_start")
        report = check_cache(adapter, prompt, 8, mode="control", scenarios="padded")
        assert report.scenarios["padded-row"].first_bug_step == want, report.format()
        assert report.scenarios["padded"].verdict == "rounding"
    assert op_first_acting_step("padded_positions_from_start", "padded-row", 8) == 0


def test_a_static_cache_never_cleared_between_prompts():
    """The first scenario's run (the fast path's, reused) prefills a clean cache; every later one reuses it as
    left: step 0 is a bug in each, and a check of ``decode`` alone cannot see it."""
    seed, _, prompt, continuation = CASES[0]
    model = tiny_model("llama", "float32", "sdpa", seed)
    if HFModel(model).takes_cache_position:
        pytest.skip("this release writes a static cache at cache_position: a prefill overwrites a cache never cleared")
    adapter = inject_op_bug(HFModel(model, new_cache=static(model, 512)), "static_never_cleared")
    report = check_cache(adapter, prompt, mode="control", continuation=continuation, scenarios=("decode", "resume"))
    assert report.scenarios["decode"].verdict == "rounding"
    assert report.scenarios["resume"].first_bug_step == 0, report.format()
    with pytest.raises(ValueError, match="allowed: an HFModel with new_cache"):
        inject_op_bug(HFModel(model), "static_never_cleared")


def test_sharing_keys_is_harmless_in_a_dynamic_cache():
    """A DynamicCache concatenates a new key tensor at every update: a fork that shares the old one reads
    nothing another branch wrote (the bug needs a cache that writes in place)."""
    seed, _, prompt, continuation = CASES[1]
    adapter = inject_op_bug(HFModel(tiny_model("llama", "float32", "sdpa", seed)), "fork_shared_keys")
    report = check_cache(adapter, prompt, mode="control", continuation=continuation, scenarios="fork")
    assert report.verdict == "rounding", report.format()


def test_a_restored_cache_keeps_an_injected_bug_on_its_own_copy():
    """The f16 bug wraps the cache's update(); a restored copy gets its own wrapper, never the original's."""
    seed, _, prompt, continuation = CASES[0]
    adapter = inject_hf_bug(HFModel(tiny_model("llama", "float32", "sdpa", seed)), "f16")
    adapter.prefill(prompt)
    state = adapter.snapshot()
    adapter.restore(state)
    assert adapter.cache is not state.cache and "update" in vars(adapter.cache)
    assert "update" not in vars(state.cache)


@pytest.mark.skipif(not STATIC_CROPS, reason=NO_STATIC_CROP)
def test_the_operation_bug_score_table(monkeypatch):
    """The command behind docs/check.md's table (python -m kvfast.studies.op_score), on one model and prompt:
    the detectors people write never see an operation bug; kvfast's operations check finds each."""
    from kvfast.studies import op_score

    monkeypatch.setattr(op_score, "FAMILIES", ("llama",))
    monkeypatch.setattr(op_score, "PROMPTS", (0,))
    table = op_score.score_table(steps=6)
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()[2:]}
    assert set(rows) == {*OP_BUGS, "all"} - {WINDOW_BUG}  # a window bug needs a family with a window
    for bug in [b for b in OP_BUGS if b not in ("padded_positions_from_start", WINDOW_BUG)]:  # Llama: rotary
        assert "| 0.000, -, 0.500 | 0.000, -, 0.500 | 1.000, " in rows[bug], table
    assert rows["crop_short"].endswith("1.000, 1, 1.000 |") and rows["fork_shared_keys"].endswith("1.000, 4, 1.000 |")


def test_the_window_bug_row_of_the_score_table(monkeypatch):
    """Mistral's row: the three-token check stops at step 1 and misses it; the per-step generation test (its
    ``steps`` compare decode steps 0 to steps - 1) and
    kvfast find it at the step where the cache first holds more than window - 1 positions."""
    from kvfast.studies import op_score

    monkeypatch.setattr(op_score, "FAMILIES", ("mistral",))
    monkeypatch.setattr(op_score, "PROMPTS", (0,))
    table = op_score.score_table(steps=9)  # prompt 0 has 4 tokens: the window (12) is first exceeded at step 8
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()[2:]}
    assert set(rows) == {WINDOW_BUG, "all"}
    want = op_first_acting_step(WINDOW_BUG, "decode", 9, 4, MISTRAL_WINDOW)
    assert want == 8
    assert rows[WINDOW_BUG] == f"| {WINDOW_BUG} | 1 | 0.000, -, 0.500 | 1.000, {want}, 1.000 | 1.000, {want}, 1.000 |"
    # failing data: a run that stops before step 8, where neither the generation test nor kvfast can see it
    short = {line.split(" | ")[0].strip("| "): line for line in op_score.score_table(steps=7).splitlines()[2:]}
    assert short[WINDOW_BUG] == f"| {WINDOW_BUG} | 1 | 0.000, -, 0.500 | 0.000, -, 0.500 | 0.000, -, 0.500 |"


# --- hybrid caches: Gemma2 and Gemma3 (sliding and full layers), prompts longer than the window ----------

HYBRID_WINDOW = 8


def tiny_hybrid(kind: str, dtype: str = "float32", seed: int = 0):
    """A tiny random Gemma2 or Gemma3 (one sliding layer of window 8, one full layer), eager attention."""
    common = dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, sliding_window=HYBRID_WINDOW,
        attn_implementation="eager",
    )  # fmt: skip
    if kind == "gemma2":
        config, cls = transformers.Gemma2Config(**common), transformers.Gemma2ForCausalLM
    else:
        config, cls = transformers.Gemma3TextConfig(**common), transformers.Gemma3ForCausalLM
    torch.manual_seed(seed)
    return cls(config).eval().to(getattr(torch, dtype))


ALL_OPS = ("decode", "resume", *OPS)


@pytest.mark.skipif(not RECORDS_PAST, reason=NO_RECORDING)
def test_a_hybrid_cache_through_every_scenario():
    model = tiny_hybrid("gemma3")
    report = check_cache(model, list(range(3, 15)), 16, mode="control", scenarios=ALL_OPS)
    assert report.verdict == "rounding", report.format()
    assert all(s.verdict == "rounding" for s in report.scenarios.values())
    bad = check_cache(inject_op_bug(HFModel(tiny_hybrid("gemma2")), "crop_short"), list(range(3, 15)), 16,
                      mode="control", scenarios="rollback")  # fmt: skip
    assert bad.scenarios["rollback"].first_bug_step == 1, bad.format()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_hybrid_models_are_never_a_bug_nor_inconclusive(kind, dtype):
    for seed in range(2):
        model = tiny_hybrid(kind, dtype, seed)
        for prompt in (list(range(3, 15)), list(range(40, 45))):  # longer and shorter than the window
            unpadded = tuple(n for n in ALL_OPS if n != "padded")
            report = check_cache(model, prompt, 16, mode="control", scenarios=unpadded, promote="float64")
            for checked in (report, report.promoted):
                assert checked.verdict == "rounding", report.format()
            # measured: in float64 a left-padded Gemma row's logits are NaN (transformers 5.24, eager), so the
            # logic check of the padded scenario is skipped with a note and the native verdict stands
            padded = check_cache(model, prompt, 16, mode="control", scenarios="padded", promote="float64")
            assert padded.verdict == "rounding" and padded.passed, padded.format()
            assert padded.promoted is None and any("logits hold nan" in n for n in padded.notes)


# --- a window that evicts one too many (the operation bug window_evicts_one_too_many) -------------------


@pytest.mark.parametrize(
    ("kind", "prompt_len", "static_cache"),
    [
        ("mistral", 4, False),
        ("gemma2", 5, True),
        pytest.param("mistral", MISTRAL_WINDOW + 3, True, marks=pytest.mark.slow),  # the prefill crosses the window
        pytest.param("gemma3", 11, False, marks=pytest.mark.slow),
    ],
)
def test_a_window_that_evicts_one_too_many_is_found_where_it_first_acts(kind, prompt_len, static_cache):
    """Every scenario's first ``bug`` step is where the cache first holds more than ``window - 1`` positions
    (step 0 for a prompt longer than the window); the same model clean has no ``bug`` step anywhere."""
    model = tiny_model("mistral", "float32", "sdpa", 0) if kind == "mistral" else tiny_hybrid(kind)
    window, prompt = model.config.sliding_window, list(range(3, 3 + prompt_len))
    new_cache = static(model) if static_cache else None
    bad = check_cache(inject_op_bug(HFModel(model, new_cache=new_cache), WINDOW_BUG), prompt, 16, mode="control",
                      scenarios=ALL_OPS)  # fmt: skip
    clean = check_cache(HFModel(model, new_cache=new_cache), prompt, 16, mode="control", scenarios=ALL_OPS)
    assert bad.verdict == "bug" and clean.verdict == "rounding", clean.format()
    for name, report in bad.scenarios.items():
        if report.verdict == "skipped":  # a static window cannot roll back (nor, before 5.15, a dynamic one)
            assert name == "rollback" and (static_cache or not RECORDS_PAST)
            continue
        want = op_first_acting_step(WINDOW_BUG, name, 16, prompt_len, window)
        assert want is not None and report.first_bug_step == want, bad.format()
        assert clean.scenarios[name].first_bug_step is None
    assert model.config.sliding_window == window  # put back after every call


def test_the_window_bug_stays_out_of_the_recompute_and_needs_a_window():
    model = tiny_model("mistral", "float32", "sdpa", 0)
    tokens = list(range(3, 3 + 2 * MISTRAL_WINDOW))
    adapter = inject_op_bug(HFModel(model), WINDOW_BUG)
    assert bool((adapter.recompute(tokens) == HFModel(model).recompute(tokens)).all())
    first = adapter.prefill(tokens)  # the cache path: the prefill's rows from position window - 1 on change
    clean = HFModel(model).prefill(tokens)
    assert bool((first[: MISTRAL_WINDOW - 1] == clean[: MISTRAL_WINDOW - 1]).all())
    assert not torch.allclose(first[MISTRAL_WINDOW - 1], clean[MISTRAL_WINDOW - 1], atol=1e-3)
    with pytest.raises(ValueError, match="allowed: an HFModel of a model with a sliding window"):
        inject_op_bug(HFModel(tiny_model("llama", "float32", "sdpa", 0)), WINDOW_BUG)
    with pytest.raises(ValueError, match="prompt_len"):
        op_first_acting_step(WINDOW_BUG, "decode", 16)
    assert op_first_acting_step(WINDOW_BUG, "decode", 4, 4, MISTRAL_WINDOW) is None  # beyond the run
    assert op_first_acting_step(WINDOW_BUG, "padded-row", 16, 4, MISTRAL_WINDOW) == MISTRAL_WINDOW - 2


# --- the offloaded cache: CUDA only in transformers 5.24 -------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="measured on CPU-only torch: the offload path needs CUDA")
@pytest.mark.parametrize("kind", ["DynamicCache", "StaticCache"])
def test_an_offloaded_cache_cannot_run_without_cuda(kind):
    """``offloading=True`` (and ``generate``'s ``cache_implementation="offloaded"``) calls
    ``torch.cuda.default_stream`` in ``Cache.update``: on CPU-only torch the model's first prefill raises
    ``AssertionError: Torch not compiled with CUDA enabled``, which kvfast reports as the model's error
    (``ModelUnderTestError``, exit 4), never as a verdict. The same cache without offloading is clean."""
    from kvfast.check import ModelUnderTestError

    model = tiny_model("llama", "float32", "sdpa", 0)
    extra = {"max_cache_len": 64} if kind == "StaticCache" else {}
    cls = getattr(transformers, kind)
    offloaded = HFModel(model, new_cache=lambda: cls(config=model.config, offloading=True, **extra))
    with pytest.raises(ModelUnderTestError, match="prefill") as caught:
        check_cache(offloaded, [3, 4, 5, 6], 4, mode="control", scenarios=ALL_OPS)
    assert isinstance(caught.value.error, AssertionError)
    assert str(caught.value.error) == "Torch not compiled with CUDA enabled"
    resident = HFModel(model, new_cache=lambda: cls(config=model.config, offloading=False, **extra))
    assert check_cache(resident, [3, 4, 5, 6], 4, mode="control", scenarios=ALL_OPS).verdict == "rounding"
