"""Issue 18 rules 2 and 6 on real tiny Hugging Face models.

- A Llama with dynamic NTK scaling crossing ``max_position_embeddings`` can be checked past its limit, and no
  mode ever says ``rounding``: the recompute rotates every key with the final length's frequencies, the cache
  keeps each key's own (verdict ``length-dependent``).
- Eager-only architectures lose the "attention" variant, not the check; a variant that would measure nothing
  (Bloom stays eager) is skipped, not trusted; the model's own exception is the model's
  (``ModelUnderTestError`` naming the call; ``kvfast check`` exit 4), never bad input.
"""

from __future__ import annotations

import functools
import os
import warnings

import pytest

if os.environ.get("KVFAST_REQUIRE_HF") == "1":  # CI (.ci/run): run these, never skip them
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

from kvfast.check import ModelUnderTestError, check_cache  # noqa: E402
from kvfast.testing import tiny_model  # noqa: E402

LIMIT = 16
PROMPT = list(range(1, 11))
STEPS = 12  # 22 positions: past the limit of 16


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


def gemma2(dtype="float32"):
    config = transformers.Gemma2Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=32, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(config).eval().to(getattr(torch, dtype))


def bloom(dtype="float32"):
    config = transformers.BloomConfig(vocab_size=96, hidden_size=32, n_layer=2, n_head=4, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.BloomForCausalLM(config).eval().to(getattr(torch, dtype))


@pytest.mark.parametrize(
    "build, why",
    [
        (gemma2, "ValueError: Gemma2ForCausalLM does not support an attention implementation"),
        (bloom, "ValueError: asked for 'sdpa' attention, the model stayed 'eager'"),
    ],
    ids=["gemma2", "bloom"],
)
def test_an_eager_only_model_loses_the_attention_variant_not_the_check(build, why):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = check_cache(build(), [1, 2, 3, 4, 5], 8, mode="control", promote="float64")
    assert report.verdict == "rounding" and report.promoted.verdict == "rounding", report.format()
    assert any(n.startswith("order-noise variant 'attention' skipped: " + why) for n in report.notes), report.notes
    assert any("variant 'batch'" in n and "variant 'rows'" in n for n in report.notes)


def test_a_value_error_of_the_models_own_forward_is_the_models():
    model = tiny_model("llama", "float32", "sdpa", 0)
    forward = model.forward

    @functools.wraps(forward)
    def refuses_long_caches(*args, **kwargs):
        if kwargs.get("use_cache") and kwargs["input_ids"].shape[1] == 1:
            raise ValueError("the sliding-window cache cannot take this prompt")
        return forward(*args, **kwargs)

    model.forward = refuses_long_caches
    want = r"^model\.decode\(\d+\) raised ModelForwardError: LlamaForCausalLM\.forward raised ValueError: the sliding"
    with pytest.raises(ModelUnderTestError, match=want):
        check_cache(model, [1, 2, 3], 4)


@pytest.mark.subprocess
def test_kvfast_check_exits_4_with_one_line_when_the_models_forward_fails(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    import kvfast

    (tmp_path / "lying.py").write_text(
        "from kvfast.testing import tiny_model\n\n\ndef make():\n"
        "    model = tiny_model('llama', 'float32', 'sdpa', 0)\n"
        "    model.config.vocab_size = 200  # the embedding holds 96\n    return model\n"
    )
    root = Path(kvfast.__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-m", "kvfast.cli", "check", "lying:make", "--prompt", "150,2", "--steps", "2"],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 4, out.stderr
    assert out.stdout == "" and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith(
        "kvfast: error: the model under test failed: model.recompute(<2 tokens>) raised IndexError"
    )
