"""Tiny random models for tests, benchmarks and examples (no download): the engines' test models, written to a
directory an engine loads.

- :func:`tiny_vllm_model`: the tiny Llama (:func:`kvfast.check.engines.tiny.tiny_llama`: hidden 128, 4 query heads
  of 32 over 2 key-value heads, which vLLM's CPU attention takes).
- :func:`tiny_hybrid_model`: a tiny model of the hybrid kind people serve, sliding-window layers beside
  full-attention ones (Gemma-3 or Gemma-2 style).
"""

from __future__ import annotations

import json
from pathlib import Path

from kvfast.validation import require_choice, require_int

#: :func:`tiny_hybrid_model`'s kinds: the transformers config and model class of each.
HYBRID_KINDS = {"gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"), "gemma2": ("Gemma2Config", "Gemma2ForCausalLM")}


def tiny_vllm_model(out, seed: int = 0, positions: int | None = None) -> Path:
    """The tiny random Llama written to ``out`` (a directory), with ``positions`` positions if given (its config's
    ``max_position_embeddings``: a long-context model, the same weights); returns ``out``."""
    from kvfast.check.engines.tiny import tiny_llama

    tiny_llama(out, seed)
    if positions is not None:
        config = Path(out) / "config.json"
        values = json.loads(config.read_text())
        values["max_position_embeddings"] = require_int(positions, "positions", 1)
        config.write_text(json.dumps(values, indent=2))
    return Path(out)


def tiny_hybrid_model(
    out, kind: str = "gemma3", seed: int = 0, window: int = 128, kv_heads: int = 1, positions: int = 512
) -> Path:
    """A tiny random hybrid model written to ``out`` (a directory; weights only, no tokenizer); returns ``out``.

    Two layers: the first attends a sliding window of ``window`` keys, the second every key (Gemma-3 interleaves
    five sliding layers to one global, Gemma-2 one to one). Hidden 128, 4 query heads of 32 over ``kv_heads``
    key-value heads (Gemma-3 1B has one), ``positions`` positions, vocabulary 256; ``kind`` one of
    :data:`HYBRID_KINDS`. Norm weights drawn (Gemma scales by ``1 + weight``), so no two norms are alike."""
    import torch
    import transformers

    config_class, model_class = HYBRID_KINDS[require_choice(kind, "kind", tuple(HYBRID_KINDS))]
    config = getattr(transformers, config_class)(
        vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=require_int(kv_heads, "kv_heads", 1), head_dim=32,
        max_position_embeddings=require_int(positions, "positions", 1), sliding_window=require_int(window, "window", 1),
        layer_types=["sliding_attention", "full_attention"], bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip
    torch.manual_seed(require_int(seed, "seed", 0))
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(0.1 * torch.randn_like(param))
    model.save_pretrained(out)
    return Path(out)
