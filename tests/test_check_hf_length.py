"""Issue 18 rules 2 and 6 on a real tiny Hugging Face Llama with dynamic NTK scaling crossing
``max_position_embeddings``: it can be checked past its limit, and no mode ever says ``rounding``: the
recompute rotates every key with the final length's frequencies, the cache keeps each key's own."""

from __future__ import annotations

import os

import pytest

if os.environ.get("KVFAST_REQUIRE_HF") == "1":  # CI (.ci/run): run these, never skip them
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

from kvfast.check import check_cache  # noqa: E402

LIMIT = 16
PROMPT = list(range(1, 11))
STEPS = 12  # 22 positions: past the limit of 16


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def llama(dtype: str, attention: str = "sdpa", rope: dict | None = None, seed: int = 0):
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=LIMIT, attn_implementation=attention,
        **({} if rope is None else {"rope_scaling": rope}),
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval().to(getattr(torch, dtype))


DYNAMIC = {"type": "dynamic", "factor": 2.0}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("mode", ["exact", "control"])
def test_dynamic_ntk_past_its_limit_is_length_dependent(dtype, mode):
    report = check_cache(llama(dtype, rope=DYNAMIC), PROMPT, STEPS, mode=mode)
    assert report.verdict == "length-dependent", report.format()
    found = report.length_dependence
    assert found.long == len(PROMPT) + STEPS and found.short < found.long and found.position >= LIMIT // 2
    assert "rounding" not in {s.verdict for s in report.scenarios.values()}


def test_bfloat16_dynamic_ntk_is_named_by_the_logic_check():
    """In bfloat16 the length dependence is below the format's resolution; the float64 logic check sees it."""
    report = check_cache(llama("bfloat16", "eager", DYNAMIC), PROMPT, STEPS, mode="control", promote="float64")
    assert report.promoted.verdict == "length-dependent"
    assert report.verdict == "length-dependent" and not report.passed
    assert "found by the logic check in float64" in report.format().splitlines()[1]


def test_a_model_without_scaling_keeps_its_limit():
    with pytest.raises(ValueError, match=r"steps: 12 is not allowed; allowed: at most 6 \(the model has 16"):
        check_cache(llama("float32"), PROMPT, STEPS)
    report = check_cache(llama("float32"), PROMPT, 6, mode="control")
    assert report.verdict == "rounding" and report.length_dependence is None
