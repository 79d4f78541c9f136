"""llama.cpp built in (kvfast.check.engines.llamacpp), tested where llama-cpp-python is installed: it builds from
source (~40 min on 2 cores), so CI does not install it; ``pip install 'kvfast[llamacpp]'`` then
``pytest tests/engines/test_engines_llamacpp.py`` runs these (docs/engines.md).

A tiny random Llama written to GGUF here (no download) is checked through llama.cpp's own KV cache (float16, the
default; float32; q8_0) against a fresh context's one-batch recompute: clean runs are ``rounding`` once the
cache's format is declared, an injected eviction is ``bug`` where it first acts, a resumed session goes through
``save_state``/``load_state``, and ``crop`` rolls the cache back.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'kvfast[llamacpp]')")
pytest.importorskip("gguf", reason="gguf is not installed (pip install 'kvfast[llamacpp]')")
torch = pytest.importorskip("torch")

from kvfast.bugs.engine_bugs import ENGINE_WINDOW as LLAMACPP_WINDOW  # noqa: E402
from kvfast.bugs.engine_bugs import inject_llamacpp_bug  # noqa: E402
from kvfast.check import check_cache  # noqa: E402
from kvfast.check.engines.llamacpp import LlamaCppModel  # noqa: E402
from kvfast.testing import tiny_gguf_model  # noqa: E402

PROMPTS = ([3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf")
    return {w: tiny_gguf_model(out, seed=1, weights=w) for w in ("f32", "f16")}, out / "hf"


def test_the_gguf_writer_gives_the_transformers_function(built):
    import transformers

    files, hf = built
    model = LlamaCppModel(files["f32"], cache="f32")
    tokens = np.array(PROMPTS[1])
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(input_ids=torch.as_tensor(tokens)[None], use_cache=False).logits[0].numpy()
    assert np.abs(model.recompute(tokens) - expected).max() < 64 * np.finfo(np.float32).eps * np.abs(expected).max()


@pytest.mark.parametrize(("weights", "cache"), [("f32", "f16"), ("f32", "f32"), ("f16", "f16"), ("f32", "q8_0")])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_clean_llama_cpp_is_rounding_with_its_cache_format_declared(built, weights, cache, prompt):
    files, hf = built
    model = LlamaCppModel(files[weights], cache=cache, hf_model=hf)
    assert model.internal_formats["kv cache"] == {"f16": "float16", "f32": "float32", "q8_0": "int8"}[cache]
    report = check_cache(model, prompt, 64, mode="control")
    assert report.verdict == "rounding", report.format()
    # a quantized cache declared as internal rounding: the report says it is lossy by design (docs/check.md, 11)
    assert any(n.startswith("internal_formats puts the KV cache in int8") for n in report.notes) == (cache == "q8_0")


def test_an_undeclared_float16_cache_is_what_made_clean_runs_bugs(built):
    files, _ = built

    model = LlamaCppModel(files["f32"], cache="f16")
    del model.internal_formats  # the adapter without its formats: the float16 cache looks like a bug
    report = check_cache(model, PROMPTS[1], 64, mode="control")
    assert report.verdict in ("bug", "inconclusive")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_an_injected_eviction_is_a_bug_where_it_first_acts_and_in_the_float32_logic_check(built, prompt):
    files, hf = built
    model = inject_llamacpp_bug(LlamaCppModel(files["f32"], cache="f16", hf_model=hf), "evict")
    report = check_cache(model, prompt, 16, mode="control", promote="float64")
    acts = max(1, LLAMACPP_WINDOW - len(prompt) + 1)
    assert report.verdict == "bug" and report.scenarios["decode"].first_bug_step == acts
    assert report.promoted.verdict == "bug" and report.promoted.logits_format == "float32"


def test_resume_goes_through_save_and_load_state_and_crop_rolls_back(built):
    files, _ = built
    clean = LlamaCppModel(files["f32"], cache="f32")
    buggy = inject_llamacpp_bug(LlamaCppModel(files["f32"], cache="f32"), "rewind")
    first = clean.llm
    clean.prefill(np.array([3, 4, 5]))
    rows = clean.extend(np.array([6, 7]))
    assert clean.llm is not first  # the resumed chunk ran on a second context loaded from the saved state
    expected = clean.recompute(np.array([3, 4, 5, 6, 7]))
    assert np.abs(rows - expected[3:]).max() <= 64 * np.finfo(np.float32).eps * np.abs(expected).max()
    for model in (clean, buggy):
        model.prefill(np.array([3, 4, 5, 6, 7, 8, 9]))
        model.crop(4)
    want = clean.recompute(np.array([3, 4, 5, 6, 11]))[-1]
    assert np.abs(clean.decode(11) - want).max() <= 64 * np.finfo(np.float32).eps * np.abs(want).max()
    assert np.abs(buggy.decode(11) - want).max() > 1e-3


def test_bad_arguments_are_one_clear_error(built, tmp_path):
    files, _ = built
    with pytest.raises(ValueError, match="^path: .*GGUF"):
        LlamaCppModel(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="^cache: 'q4'"):
        LlamaCppModel(files["f32"], cache="q4")


@pytest.mark.parametrize("bug", [None, "rewind"])
def test_rollback_and_fork_scenarios_run_on_llama_cpp(built, bug):
    files, hf = built
    model = inject_llamacpp_bug(LlamaCppModel(files["f32"], cache="f16", hf_model=hf), bug)
    report = check_cache(model, PROMPTS[1], 24, mode="control", scenarios=("rollback", "fork"))
    if bug is None:
        assert report.verdict == "rounding", report.format()
    else:  # crop keeps one token too many from the first rollback (before step 1) on
        assert report.scenarios["rollback"].verdict == "bug"
        assert report.scenarios["rollback"].first_bug_step == 1


def test_a_llama_object_is_checked_as_its_file_with_its_cache_type(built):
    import llama_cpp

    files, hf = built
    llm = llama_cpp.Llama(str(files["f32"]), n_ctx=128, type_k=llama_cpp.GGML_TYPE_F16,
                          type_v=llama_cpp.GGML_TYPE_F16, verbose=False)  # fmt: skip
    model = LlamaCppModel(llm, hf_model=hf)
    assert (model.path, model.cache_type, model.max_positions) == (files["f32"], "f16", 128)
    report = check_cache(llm, PROMPTS[1], 32, mode="control")  # the object, as a user has it
    assert report.verdict in ("rounding", "inconclusive"), report.format()  # no transformers variant given
    assert check_cache(model, PROMPTS[1], 32, mode="control").verdict == "rounding"
