"""onnxruntime-genai built in (kvfast.check.engines.ort): tiny random Llamas converted here by the engine's own
model builder (no download), checked through the engine's own generator against a plain onnxruntime session.

Clean models in control mode are `rounding` in both scenarios with the cross-implementation variant (the same
weights recomputed in transformers); an injected eviction is `bug` at the step where it first acts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

if os.environ.get("KVFAST_REQUIRE_HF") == "1":  # CI (.ci/run): run these, never skip them
    import onnxruntime_genai  # noqa: F401
    import torch
else:
    pytest.importorskip("onnxruntime_genai")
    torch = pytest.importorskip("torch")

from kvfast.check import check_cache  # noqa: E402
from kvfast.check.engines.ort import ORT_WINDOW, ORTModel  # noqa: E402

torch.set_num_threads(1)
PROMPTS = ([3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny random Llama (seed 1) in transformers and, converted, in onnxruntime-genai: ``(onnx dir, hf dir)``.
    Built (once, the slow part of this file) by the engines study's own builder, where the study finds its seed-1
    ort model when ``KVFAST_ENGINE_MODELS`` is :func:`engine_models` of the onnx dir."""
    from kvfast.studies.engines import _built

    with pytest.MonkeyPatch.context() as env:
        env.setenv("KVFAST_ENGINE_MODELS", str(tmp_path_factory.mktemp("engine-models")))
        out = _built(1, "ort", "f32")  # tiny_ort_model(<root>/<version>-seed1/ort-f32, seed=1)
    return out / "onnx", out / "hf"


def engine_models(onnx: Path) -> Path:
    """The ``KVFAST_ENGINE_MODELS`` root that holds the ``built`` model ``onnx``."""
    return onnx.parents[2]


def test_the_recompute_is_the_same_graph_as_the_prefill_and_the_same_function_as_transformers(built):
    onnx, hf = built
    import transformers

    model = ORTModel(onnx)
    tokens = np.array(PROMPTS[1])
    # the engine's generator and the plain session run one graph: the prefill is the recompute, bit for bit
    assert np.array_equal(model.prefill(tokens), model.recompute(tokens))
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(input_ids=torch.as_tensor(tokens)[None], use_cache=False).logits[0].numpy()
    scale = np.abs(expected).max()
    # the same weights: a converted model within float32 rounding of transformers (a wrong conversion is ~1 relative)
    assert np.abs(model.recompute(tokens) - expected).max() < 64 * np.finfo(np.float32).eps * scale
    assert model.internal_formats == {"kv cache": "float32", "compute": "float32"}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_clean_engine_is_rounding_in_both_scenarios_with_the_cross_implementation_variant(built, prompt):
    onnx, hf = built
    model = ORTModel(onnx, variants=("batch", "no-opt", "transformers"), hf_model=hf)
    report = check_cache(model, prompt, 64, mode="control")
    assert report.verdict == "rounding", report.format()
    assert set(report.scenarios) == {"decode", "resume"}
    assert all(s.verdict == "rounding" for s in report.scenarios.values())
    assert any("variant 'transformers'" in note for note in report.notes)


def test_exact_mode_names_the_first_step_where_the_engine_decode_differs(built):
    onnx, _ = built
    report = check_cache(ORTModel(onnx), PROMPTS[0], 16, mode="exact")
    decode = report.scenarios["decode"]
    assert decode.deviation[0] == 0.0  # prefill and recompute: one graph, one order
    if decode.first_divergent_step is not None:  # the decode kernel sums in another order than the prefill
        assert decode.first_divergent_step >= 1


@pytest.mark.parametrize("prompt", PROMPTS)
def test_an_injected_eviction_is_a_bug_at_the_step_where_it_first_acts(built, prompt):
    onnx, hf = built
    model = ORTModel(onnx, variants=("batch", "transformers"), hf_model=hf, bug="evict")
    report = check_cache(model, prompt, 16, mode="control")
    # decode step t runs at length len(prompt) + t - 1 before its token: the eviction acts from that length's window
    acts = max(1, ORT_WINDOW - len(prompt) + 1)
    assert report.verdict == "bug"
    assert report.scenarios["decode"].first_bug_step == acts


def test_crop_rewinds_the_engine_cache_and_the_injected_rewind_keeps_one_token_too_many(built):
    onnx, _ = built
    tokens = np.array([3, 4, 5, 6, 7, 8, 9])
    clean, buggy = ORTModel(onnx), ORTModel(onnx, bug="rewind")
    for model in (clean, buggy):
        model.prefill(tokens)
        model.crop(4)
    expected = clean.recompute(np.array([3, 4, 5, 6, 11]))[-1]
    good, bad = clean.decode(11), buggy.decode(11)
    assert np.abs(good - expected).max() <= 64 * np.finfo(np.float32).eps * np.abs(expected).max()
    assert np.abs(bad - expected).max() > 1e-3  # the kept token moves the logits far past rounding


def test_bad_paths_and_options_are_one_clear_error(built, tmp_path):
    onnx, _ = built
    with pytest.raises(ValueError, match="^path: .*onnxruntime-genai model directory"):
        ORTModel(tmp_path)
    with pytest.raises(ValueError, match="^variants: 'transformers'"):
        ORTModel(onnx, variants=("transformers",))
    with pytest.raises(ValueError, match="^bug: 'nope'"):
        ORTModel(onnx, bug="nope")


def test_kvfast_check_engine_ort_checks_a_model_directory_and_refuses_a_bad_one(built, tmp_path):
    onnx, hf = built
    cmd = [
        sys.executable,
        "-c",
        "import sys; from kvfast.cli import main; sys.exit(main())",
        "check",
        "--engine",
        "ort",
    ]
    args = ["--prompt", "3,4,5,6,7", "--steps", "8", "--mode", "control",
            "--factory-arg", "variants=('batch','transformers')", "--factory-arg", f"hf_model={hf}"]  # fmt: skip
    done = subprocess.run([*cmd, str(onnx), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ROUNDING" in done.stdout
    bad = subprocess.run([*cmd, str(tmp_path), "--prompt", "1,2"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "onnxruntime-genai model directory" in bad.stderr


def test_the_engines_study_checks_one_model_in_transformers_and_onnxruntime_genai(built, monkeypatch):
    from kvfast.studies.engines import STUDY

    monkeypatch.setenv("KVFAST_ENGINE_MODELS", str(engine_models(built[0])))  # seed 1's ort model: `built`
    base = {"weights": "f32", "cache": "native", "seed": 1, "prompt": 0, "steps": 12}
    for engine in ("transformers", "ort"):
        clean = {**base, "engine": engine, "bug": "none"}
        bugged = {**clean, "bug": "evict"}
        STUDY.validate_config(clean)
        out, found = STUDY.run(clean), STUDY.run(bugged)
        assert out["verdict"] == "rounding" and out["first_bug_step"] == -1
        assert found["verdict"] == "bug" and found["first_bug_step"] == found["acts_at"] == 4  # a 5-token prompt
    with pytest.raises(ValueError, match="^weights/cache: f16/native is not allowed for ort"):
        STUDY.validate_config({**base, "engine": "ort", "bug": "none", "weights": "f16"})
    with pytest.raises(ValueError, match="^engine: 'vllm' is not allowed"):
        STUDY.validate_config({**base, "engine": "vllm", "bug": "none"})


def test_other_weights_offered_as_the_transformers_variant_are_refused_not_taken_for_noise(built, tmp_path):
    onnx, _ = built
    from kvfast.check.engines.tiny import tiny_llama

    tiny_llama(tmp_path / "other", seed=7)  # a wrong conversion looks like this: another function entirely
    model = ORTModel(onnx, variants=("batch", "transformers"), hf_model=tmp_path / "other")
    report = check_cache(model, PROMPTS[0], 8, mode="control")
    assert any(note.startswith("variant 'transformers'") and "not admitted" in note for note in report.notes)
    assert report.verdict != "bug"  # refusing the source never turns a clean engine into a bug by itself


def test_check_cache_takes_an_onnxruntime_genai_directory_as_it_is(built):
    onnx, _ = built
    report = check_cache(str(onnx), PROMPTS[0], 8, mode="control", scenarios="decode")
    assert report.scenarios["decode"].verdict in ("rounding", "inconclusive")  # no cross-implementation variant


@pytest.mark.parametrize("bug", [None, "rewind"])
def test_the_rollback_scenario_runs_on_rewind_to(built, bug):
    onnx, hf = built
    model = ORTModel(onnx, variants=("batch", "transformers"), hf_model=hf, bug=bug)
    report = check_cache(model, PROMPTS[1], 24, mode="control", scenarios=("rollback",))
    rollback = report.scenarios["rollback"]
    assert rollback.verdict == ("rounding" if bug is None else "bug"), report.format()
    if bug is not None:  # rewind_to keeps one token too many from the first rollback (before step 1) on
        assert rollback.first_bug_step == 1
