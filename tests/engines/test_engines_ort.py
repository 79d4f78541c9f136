"""onnxruntime-genai built in (kvfast.check.engines.ort): tiny random Llamas converted here by the engine's own
model builder (no download), checked through the engine's own generator against a plain onnxruntime session.

Clean models in control mode are `rounding` in both scenarios with the cross-implementation variant (the same
weights recomputed in transformers); an injected eviction is `bug` at the step where it first acts. The same for
an int8 build (weight-only MatMulNBits, int8 activations), whose transformers variant is the build's weights
dequantized (checked against onnxruntime's own MatMulNBits kernel).
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

from kvfast.bugs.engine_bugs import ENGINE_WINDOW as ORT_WINDOW  # noqa: E402
from kvfast.bugs.engine_bugs import ORT_BUGS, inject_ort_bug  # noqa: E402
from kvfast.check import check_cache  # noqa: E402
from kvfast.check.engines.ort import DEFAULT_VARIANTS, ORTModel  # noqa: E402
from kvfast.testing import tiny_ort_model  # noqa: E402

#: the models are built by onnxruntime-genai's builder in a Python process (the module's fixtures)
pytestmark = pytest.mark.subprocess
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
    model = inject_ort_bug(ORTModel(onnx, variants=("batch", "transformers"), hf_model=hf), "evict")
    report = check_cache(model, prompt, 16, mode="control")
    # decode step t runs at length len(prompt) + t - 1 before its token: the eviction acts from that length's window
    acts = max(1, ORT_WINDOW - len(prompt) + 1)
    assert report.verdict == "bug"
    assert report.scenarios["decode"].first_bug_step == acts


def test_crop_rewinds_the_engine_cache_and_the_injected_rewind_keeps_one_token_too_many(built):
    onnx, _ = built
    tokens = np.array([3, 4, 5, 6, 7, 8, 9])
    clean, buggy = ORTModel(onnx), inject_ort_bug(ORTModel(onnx), "rewind")
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
    with pytest.raises(ValueError, match="^bug: 'nope' is not allowed; allowed: evict, rewind"):
        inject_ort_bug(ORTModel(onnx), "nope")
    model = ORTModel(onnx)
    assert inject_ort_bug(model, "evict") is model and type(model).__name__ == "ORTModel"  # in place, same name
    assert repr(model) == f"ORTModel({str(onnx)!r}, bug='evict')" and model.promote("float64") is model


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
    plain = [*cmd, str(onnx), "--prompt", "9,8,7,6,5,4,3,2,1", "--steps", "32", "--mode", "control"]
    alone = subprocess.run(plain, capture_output=True, text=True, timeout=300)  # no outside weights
    assert alone.returncode == 0 and "ROUNDING" in alone.stdout, alone.stdout + alone.stderr
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
    with pytest.raises(
        ValueError, match="^weights/cache: f16/native is not allowed for ort; allowed: f32/native, int8"
    ):
        STUDY.validate_config({**base, "engine": "ort", "bug": "none", "weights": "f16"})
    STUDY.validate_config({**base, "engine": "ort", "bug": "none", "weights": "int8"})  # the int8 build
    with pytest.raises(ValueError, match="^weights/cache: int8/native is not allowed for transformers; allowed: f32/"):
        STUDY.validate_config({**base, "engine": "transformers", "bug": "none", "weights": "int8"})
    with pytest.raises(ValueError, match="^engine: 'vllm' is not allowed"):
        STUDY.validate_config({**base, "engine": "vllm", "bug": "none"})


def test_other_weights_offered_as_the_transformers_variant_are_refused_not_taken_for_noise(built, tmp_path):
    onnx, _ = built
    from kvfast.testing import tiny_llama

    tiny_llama(tmp_path / "other", seed=7)  # a wrong conversion looks like this: another function entirely
    model = ORTModel(onnx, variants=("batch", "transformers"), hf_model=tmp_path / "other")
    report = check_cache(model, PROMPTS[0], 8, mode="control")
    assert any(note.startswith("variant 'transformers'") and "not admitted" in note for note in report.notes)
    assert report.verdict != "bug"  # refusing the source never turns a clean engine into a bug by itself


def test_check_cache_takes_an_onnxruntime_genai_directory_as_it_is(built):
    onnx, _ = built
    report = check_cache(str(onnx), PROMPTS[0], 8, mode="control", scenarios="decode")
    assert report.scenarios["decode"].verdict == "rounding", report.format()  # the engine's own variants


# --- the engine's own order noise: no outside weights ---------------------------------------------------------

ALL_PROMPTS = (*PROMPTS, list(range(10, 40)))


@pytest.mark.parametrize("prompt", ALL_PROMPTS)
def test_a_clean_engine_without_outside_weights_is_rounding_in_both_scenarios(built, prompt):
    onnx, _ = built
    model = ORTModel(onnx)  # no hf_model: the default variants are the engine's own
    assert model.variants == DEFAULT_VARIANTS
    report = check_cache(model, prompt, 64, mode="control")
    assert report.verdict == "rounding", report.format()
    assert {name: s.verdict for name, s in report.scenarios.items()} == {"decode": "rounding", "resume": "rounding"}
    assert any("variant 'chunk'" in note and "not admitted" not in note for note in report.notes)


def test_without_the_chunk_variant_the_clean_engine_is_inconclusive_its_batch_and_session_variants_are_exact(built):
    """Why a correct fp32 engine was `inconclusive`: every variant but the one-token chunks, and the prefix
    recomputes, equal the recompute bit for bit, so the bound is one float32 unit; the decode lands further."""
    onnx, _ = built
    model = ORTModel(onnx, variants=("batch", "no-opt", "threads", "chunk"))
    tokens = np.array([*PROMPTS[1], *range(10, 30)])
    reference = model.recompute(tokens)
    variants = model.recompute_variants(tokens)
    for name in ("batch", "no-opt", "threads"):
        assert np.array_equal(variants[name], reference), name
    assert np.array_equal(model.recompute(tokens[:11]), reference[:11])  # append-invariant: no batch-shape draw
    chunk = np.abs(variants["chunk"] - reference).max(-1)
    assert np.count_nonzero(chunk) > len(tokens) // 2  # a draw of the one-row order at most positions
    assert chunk.max() <= 64 * np.finfo(np.float32).eps * np.abs(reference).max()  # rounding, no logic change
    # failing data for the criterion above: the same clean engine without the chunk variant
    report = check_cache(ORTModel(onnx, variants=("batch", "no-opt")), PROMPTS[1], 64, mode="control")
    assert report.verdict == "inconclusive", report.format()


@pytest.mark.parametrize("bug", ["evict", "rewind"])
def test_an_injected_bug_never_reaches_the_chunk_variant(built, bug):
    onnx, _ = built
    tokens = np.array([*PROMPTS[1], *range(10, 30)])
    clean = ORTModel(onnx, variants="chunk").recompute_variants(tokens)["chunk"]
    buggy = inject_ort_bug(ORTModel(onnx, variants="chunk"), bug)
    buggy.prefill(tokens[:9])  # the generator under test holds a cache; the variant never reads it
    buggy.crop(4)
    assert np.array_equal(buggy.recompute_variants(tokens)["chunk"], clean)


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("kv_format", ["float32", "float16"])
def test_injected_bugs_are_bugs_where_they_first_act_without_outside_weights(built, prompt, kv_format):
    """float32, and a float16 cache declared (the floor and the admission ceiling in float16: what a float16
    build is judged against; onnxruntime-genai's own fp16 CPU build fails in its decode here)."""
    onnx, _ = built

    def model(bug):
        m = inject_ort_bug(ORTModel(onnx), bug)
        m.internal_formats = {**m.internal_formats, "kv cache": kv_format}
        return m

    for name, bug in ORT_BUGS.items():  # each where the catalogue says it first acts
        scenarios = [s for s in ("decode", "resume", "rollback") if bug.first_acting_step(s, len(prompt)) is not None]
        report = check_cache(model(name), prompt, 16, mode="control", scenarios=scenarios)
        assert report.verdict == "bug", report.format()
        found = {s: r.first_bug_step for s, r in report.scenarios.items()}
        assert found == {s: bug.first_acting_step(s, len(prompt)) for s in scenarios}, name
    assert ORT_BUGS["evict"].first_acting_step("decode", len(prompt)) == max(1, ORT_WINDOW - len(prompt) + 1)
    clean = check_cache(model(None), prompt, 16, mode="control", scenarios=("decode", "resume", "rollback"))
    assert clean.verdict == "rounding", clean.format()


class _LosesPast(ORTModel):
    """A chunk variant that drops the oldest cached position once the past holds 8: a logic bug in it."""

    def _feeds(self, ids, past):
        if past and next(iter(past.values())).shape[2] >= 8 and ids.shape[0] == 1:
            past = {name: v[:, :, 1:] for name, v in past.items()}
        return super()._feeds(ids, past)


def test_a_chunk_variant_off_by_more_than_rounding_is_refused_not_taken_for_noise(built):
    onnx, _ = built
    report = check_cache(_LosesPast(onnx, variants=("batch", "chunk")), PROMPTS[1], 16, mode="control")
    assert any(note.startswith("variant 'chunk'") and "not admitted" in note for note in report.notes)
    assert report.verdict != "rounding"  # judged without it: one float32 unit


def test_the_logic_check_runs_in_float32_and_says_so(built):
    onnx, _ = built
    report = check_cache(ORTModel(onnx), PROMPTS[0], 16, mode="control", promote="float64")
    assert report.verdict == "rounding" and report.promoted.verdict == "rounding"
    assert report.promoted.logits_format == "float32"
    assert any("logic check ran in float32" in note for note in report.notes)
    bugged = check_cache(inject_ort_bug(ORTModel(onnx), "evict"), PROMPTS[0], 16, mode="control", promote="float64")
    assert bugged.promoted.verdict == "bug"


@pytest.mark.parametrize("bug", [None, "rewind"])
def test_the_rollback_scenario_runs_on_rewind_to(built, bug):
    onnx, hf = built
    model = inject_ort_bug(ORTModel(onnx, variants=("batch", "transformers"), hf_model=hf), bug)
    report = check_cache(model, PROMPTS[1], 24, mode="control", scenarios=("rollback",))
    rollback = report.scenarios["rollback"]
    assert rollback.verdict == ("rounding" if bug is None else "bug"), report.format()
    if bug is not None:  # rewind_to keeps one token too many from the first rollback (before step 1) on
        assert rollback.first_bug_step == 1


# --- int8 builds (weight-only MatMulNBits; the CPU kernel rounds activations to int8) ----------------------


def _matmulnbits_session(codes, scales, zero_points, *, bits: int, block_size: int, k: int, accuracy_level: int):
    """One ``MatMulNBits`` node over the given initializers, as a one-thread onnxruntime session."""
    import onnxruntime
    from onnx import TensorProto, helper, numpy_helper

    n = codes.shape[0]
    inits = [numpy_helper.from_array(codes, "B"), numpy_helper.from_array(scales, "S")]
    inputs = ["A", "B", "S"]
    if zero_points is not None:
        inits.append(numpy_helper.from_array(zero_points, "Z"))
        inputs.append("Z")
    node = helper.make_node("MatMulNBits", inputs, ["Y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=block_size, accuracy_level=accuracy_level)  # fmt: skip
    a, y = (helper.make_tensor_value_info(name, TensorProto.FLOAT, [None, d]) for name, d in (("A", k), ("Y", n)))
    graph = helper.make_graph([node], "g", [a], [y], initializer=inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    model = helper.make_model(graph, opset_imports=opsets)
    return onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _codes(rng, n: int, k: int, block_size: int, bits: int, zero_points: bool):
    blocks = -(-k // block_size)
    codes = rng.integers(0, 256, (n, blocks, block_size * bits // 8), dtype=np.uint8)
    scales = (0.001 + 0.01 * rng.random((n, blocks))).astype(np.float32)
    zeros = rng.integers(0, 256, (n, -(-blocks * bits // 8)), dtype=np.uint8) if zero_points else None
    return codes, scales, zeros


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("zero_points", [False, True])
def test_dequantize_matmulnbits_is_the_weight_onnxruntime_multiplies_by(bits, zero_points):
    from kvfast.check.engines.ort import dequantize_matmulnbits

    rng = np.random.default_rng(bits + 10 * zero_points)
    n, k, block = 48, 96, 32
    codes, scales, zeros = _codes(rng, n, k, block, bits, zero_points)
    session = _matmulnbits_session(codes, scales, zeros, bits=bits, block_size=block, k=k, accuracy_level=0)
    a = rng.standard_normal((16, k)).astype(np.float32)
    engine = session.run(None, {"A": a})[0].astype(np.float64)
    scale = np.abs(engine).max()
    eps = float(np.finfo(np.float32).eps)

    def off(weight):  # the largest deviation of a @ weight.T from the engine, in float32 units of its largest value
        return np.abs(a.astype(np.float64) @ weight.T.astype(np.float64) - engine).max() / (eps * scale)

    weight = dequantize_matmulnbits(codes, scales, zeros, bits=bits, block_size=block, k=k)
    print(f"bits {bits}, zero points {zero_points}: {off(weight):.2f} float32 units")
    assert weight.shape == (n, k) and weight.dtype == np.float32
    assert off(weight) <= 8  # the same weights, another summation order
    # failing data: another zero point, or the codes read high bits first, is another weight altogether
    other_zero = None if zero_points else np.zeros((n, -(-k // block * bits // 8)), np.uint8)  # packed zeros
    shifted = dequantize_matmulnbits(codes, scales, other_zero, bits=bits, block_size=block, k=k)
    assert off(shifted) > 1e3
    if bits == 4:
        swapped = ((codes >> 4) | (codes << 4)).astype(np.uint8)
        assert off(dequantize_matmulnbits(swapped, scales, zeros, bits=bits, block_size=block, k=k)) > 1e3


def test_fake_quantize_int8_blocks_is_what_accuracy_level_4_does_to_the_input():
    from kvfast.check.engines.ort import dequantize_matmulnbits, fake_quantize_int8_blocks

    rng = np.random.default_rng(3)
    n, k, block = 64, 128, 32
    codes, scales, _ = _codes(rng, n, k, block, 8, False)
    weight = dequantize_matmulnbits(codes, scales, None, bits=8, block_size=block, k=k).astype(np.float64)
    a = rng.standard_normal((256, k)).astype(np.float32)
    a[:, :block] *= 10  # blocks of other ranges: each block has its own scale
    engine = _matmulnbits_session(codes, scales, None, bits=8, block_size=block, k=k, accuracy_level=4)
    y = engine.run(None, {"A": a})[0].astype(np.float64)
    eps, scale = float(np.finfo(np.float32).eps), np.abs(y).max()
    rounded = fake_quantize_int8_blocks(torch.from_numpy(a), block).numpy().astype(np.float64)
    emulated = np.abs(rounded @ weight.T - y).max() / (eps * scale)
    plain = np.abs(a.astype(np.float64) @ weight.T - y).max() / (eps * scale)
    print(f"accuracy_level 4: {emulated:.2f} float32 units from int8-rounded inputs, {plain:.3g} from float ones")
    assert emulated <= 8
    assert plain > 1e3  # the float input is not what the kernel multiplies: the rounding to int8 is real
    # levels 0 to 3 (unset, float32, float16, bfloat16) compute a float32 input in float32 on this CPU kernel
    for level in range(4):
        session = _matmulnbits_session(codes, scales, None, bits=8, block_size=block, k=k, accuracy_level=level)
        y_level = session.run(None, {"A": a})[0].astype(np.float64)
        assert np.abs(a.astype(np.float64) @ weight.T - y_level).max() / (eps * scale) <= 8, level
    # per block: another block size is another rounding
    assert np.abs(fake_quantize_int8_blocks(torch.from_numpy(a), 2 * block).numpy() @ weight.T - y).max() > 1e3 * (
        eps * scale
    )


@pytest.fixture(scope="module")
def built_int8(tmp_path_factory):
    """The tiny random Llama of seed 1 converted with ``-p int8``: ``(onnx dir, hf dir)``."""
    out = tmp_path_factory.mktemp("ort8")
    return tiny_ort_model(out, seed=1, precision="int8"), out / "hf"


def test_an_int8_build_declares_int8_activations_read_from_its_graph(built_int8, built):
    from kvfast.check.engines.ort import quantized_matmuls

    onnx, _ = built_int8
    nodes = quantized_matmuls(onnx / "model.onnx", weights=False)
    # every linear layer (q/k/v fused, o, gate, up, down per layer, and the head) is int8, rounding its input
    assert len(nodes) == 11 and {(q.bits, q.accuracy_level) for q in nodes} == {(8, 4)}
    model = ORTModel(onnx)
    assert model.internal_formats == {"kv cache": "float32", "compute": "float32", "activations": "int8"}
    assert ORTModel(built[0]).internal_formats == {"kv cache": "float32", "compute": "float32"}  # no MatMulNBits


def test_the_dequantized_transformers_model_is_the_int8_engine_up_to_order(built_int8):
    import transformers

    from kvfast.check.engines.ort import dequantized_transformers

    onnx, hf = built_int8
    model = ORTModel(onnx)
    tokens = np.array([9, 8, 7, 6, 5, 4, 3, 2, 1, *range(10, 40)])
    engine = model.recompute(tokens)
    scale = np.abs(engine).max(-1)
    eps = float(np.finfo(np.float32).eps)
    original = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()

    def units(m):  # the largest relative deviation from the engine's recompute, in float32 units
        with torch.no_grad():
            logits = m(input_ids=torch.as_tensor(tokens)[None], use_cache=False).logits[0].numpy()
        return float((np.abs(logits - engine).max(-1) / scale).max() / eps)

    same = dequantized_transformers(original, onnx / "model.onnx")
    float_inputs = dequantized_transformers(original, onnx / "model.onnx")
    for layer in float_inputs.modules():
        layer._forward_pre_hooks.clear()  # the build's weights, but float32 activations
    figures = {"dequantized, int8 activations": units(same), "dequantized, float activations": units(float_inputs),
               "the float weights it was built from": units(original)}  # fmt: skip
    print({k: f"{v:.3g} float32 units" for k, v in figures.items()})
    assert figures["dequantized, int8 activations"] <= 16  # the same function, another order
    assert figures["dequantized, float activations"] > 1e3
    assert figures["the float weights it was built from"] > 1e3
    assert not any(layer._forward_pre_hooks for layer in original.modules())  # the caller's model untouched


def test_a_clean_int8_engine_is_rounding_and_an_injected_eviction_a_bug_where_it_first_acts(built_int8):
    onnx, hf = built_int8
    variants = ("batch", "no-opt", "transformers")
    clean = check_cache(ORTModel(onnx, variants=variants, hf_model=hf), PROMPTS[1], 24, mode="control")
    assert clean.verdict == "rounding", clean.format()
    assert any("variant 'transformers'" in note and "not admitted" not in note for note in clean.notes)
    # failing data: undeclared, the int8 activations' rounding (one code moved where the two paths' float32 inputs
    # straddle a rounding boundary, 1e-3 relative) is judged against float32 alone, and the variant that shows it
    # is refused as noise
    undeclared = ORTModel(onnx, variants=variants, hf_model=hf)
    undeclared.internal_formats = {"kv cache": "float32", "compute": "float32"}
    assert check_cache(undeclared, PROMPTS[1], 24, mode="control").verdict == "bug"
    bugged = check_cache(
        inject_ort_bug(ORTModel(onnx, variants=variants, hf_model=hf), "evict"), PROMPTS[0], 16, mode="control"
    )
    assert bugged.verdict == "bug"
    assert bugged.scenarios["decode"].first_bug_step == ORT_WINDOW - len(PROMPTS[0]) + 1


@pytest.mark.slow
def test_int8_clean_runs_are_rounding_over_two_seeds_two_prompts_64_steps(tmp_path):
    """The issue's bar for int8: 2 seeds x 2 prompts x 64 steps, both scenarios, 0 bug and 0 inconclusive."""
    verdicts = []
    for seed in (0, 1):
        onnx = tiny_ort_model(tmp_path / f"seed{seed}", seed=seed, precision="int8")
        model = ORTModel(onnx, variants=("batch", "no-opt", "transformers"), hf_model=tmp_path / f"seed{seed}" / "hf")
        for prompt in PROMPTS:
            report = check_cache(model, prompt, 64, mode="control")
            verdicts += [s.verdict for s in report.scenarios.values()]
    assert verdicts == ["rounding"] * 8


# --- an onnxruntime_genai.Model given as it is ------------------------------------------------------------------


def test_an_onnxruntime_genai_model_object_is_checked_as_its_directory_is(built):
    import onnxruntime_genai as og

    onnx, _ = built
    loaded, directory = ORTModel(og.Model(str(onnx))), ORTModel(onnx)
    assert loaded.variants == ("batch", "chunk") and loaded.internal_formats == directory.internal_formats
    assert (loaded.vocab_size, loaded.max_positions) == (directory.vocab_size, directory.max_positions)
    tokens = np.array([*PROMPTS[1], *range(10, 30)])
    # through fresh generators of the object: the same rows as the directory's plain session, bit for bit
    assert np.array_equal(loaded.recompute(tokens), directory.recompute(tokens))
    ours, theirs = loaded.recompute_variants(tokens), directory.recompute_variants(tokens)
    assert all(np.array_equal(ours[name], theirs[name]) for name in ours)
    for prompt in ALL_PROMPTS:
        report = check_cache(og.Model(str(onnx)), prompt, 64, mode="control")  # the object, as a user has it
        assert report.verdict == "rounding", report.format()
        assert set(report.scenarios) == {"decode", "resume"}
    evicted = check_cache(inject_ort_bug(ORTModel(og.Model(str(onnx))), "evict"), PROMPTS[0], 16, mode="control")
    assert evicted.verdict == "bug" and evicted.scenarios["decode"].first_bug_step == ORT_WINDOW - 4
    with pytest.raises(ValueError, match="^variants: 'no-opt' is not allowed; allowed: batch, chunk, transformers"):
        ORTModel(og.Model(str(onnx)), variants=("batch", "no-opt"))
