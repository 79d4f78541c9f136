"""Tiny random models for tests and examples, built from configs with random weights (nothing is downloaded):
a Hugging Face causal LM (:func:`tiny_model`), the Llama every engine's test model is converted from
(:func:`tiny_llama`) and that Llama as an onnxruntime-genai model (:func:`tiny_ort_model`) and a GGUF file
(:func:`tiny_gguf_model`) and a vLLM model directory (:func:`tiny_vllm_model`), a hybrid model of sliding-window
and full-attention layers for vLLM (:func:`tiny_hybrid_model`), and a TransformerLens ``HookedTransformer``
(:func:`tiny_tl_config`, :func:`tiny_tl_model`). Each factory imports its heavy packages itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvfast.validation import import_extra, require_choice, require_int

# --- a tiny Hugging Face causal LM (tests, benchmarks, the hf studies) ------------------------------------------

FAMILIES = ("llama", "gpt2", "mistral", "qwen2")
DTYPES = ("float32", "float64", "bfloat16")
ATTENTION = ("sdpa", "eager")
TINY_VOCAB = 96
TINY_POSITIONS = 512
MISTRAL_WINDOW = 12


def tiny_model(family: str = "llama", dtype: str = "float32", attention: str = "sdpa", seed: int = 0):
    """A tiny random causal LM from a config (no download): 2 layers, hidden 32, vocab 96, in eval mode.

    ``family``: :data:`FAMILIES` (``mistral`` has a sliding window of
    :data:`MISTRAL_WINDOW` positions); ``dtype``: :data:`DTYPES`;
    ``attention``: :data:`ATTENTION`; ``seed`` seeds the weights.
    """
    torch = import_extra("torch", "a tiny Hugging Face model", "hf")
    import transformers

    require_choice(family, "family", FAMILIES)
    require_choice(dtype, "dtype", DTYPES)
    require_choice(attention, "attention", ATTENTION)
    seed = require_int(seed, "seed", 0)
    common = dict(vocab_size=TINY_VOCAB, attn_implementation=attention)
    llama_like = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=TINY_POSITIONS, **common,
    )  # fmt: skip
    gpt2 = dict(n_embd=32, n_layer=2, n_head=4, n_positions=TINY_POSITIONS, bos_token_id=0, eos_token_id=0, **common)
    config_class, model_class, fields = {
        "gpt2": ("GPT2Config", "GPT2LMHeadModel", gpt2),
        "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=MISTRAL_WINDOW, **llama_like)),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", llama_like),
        "llama": ("LlamaConfig", "LlamaForCausalLM", llama_like),
    }[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**fields)).eval()
    return model.to(getattr(torch, dtype))


# --- the tiny Llama of the engines' tests, as transformers weights, ONNX and GGUF ----------------------------------

#: The tiny Llama's shape. No linear layer has as many outputs as the vocabulary: onnxruntime-genai 0.18's
#: builder takes any such layer for the language-model head (an MLP width of 128 = the vocabulary wired the head
#: to layer 0's MLP input; a hidden size of 128 to an attention projection). Head size 32: llama.cpp's q8_0 KV
#: cache stores blocks of 32.
TINY_LLAMA = dict(
    vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=1,
)  # fmt: skip


def tiny_llama(out, seed: int = 0):
    """Write a tiny random Llama (:data:`TINY_LLAMA`; norm weights drawn too, so no two norms are alike) and a
    word-level tokenizer (``t0`` ... ``t255``) to the directory ``out``; return the model (float32, eval)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    seed = require_int(seed, "seed", 0)
    out = Path(out)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
    model.save_pretrained(out)
    vocab = TINY_LLAMA["vocab_size"]
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t2"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, bos_token="t0", eos_token="t1", pad_token="t1", unk_token="t2"
    ).save_pretrained(out)
    return model


PRECISIONS = ("fp32", "fp16", "int8", "int4")


def tiny_ort_model(out, seed: int = 0, precision: str = "fp32") -> Path:
    """Build a tiny random Llama (:func:`tiny_llama`) in ``out/hf`` and convert it
    with onnxruntime-genai's model builder into ``out/onnx`` (``precision``: :data:`PRECISIONS`, CPU; int8 and
    int4 are the builder's weight-only ``MatMulNBits`` quantization with its CPU defaults: symmetric, blocks of
    32, ``accuracy_level`` 4); return ``out/onnx``. Nothing is downloaded; about 10 s."""
    import subprocess
    import sys

    require_choice(precision, "precision", PRECISIONS)
    out = Path(out)
    hf, onnx = out / "hf", out / "onnx"
    tiny_llama(hf, seed)
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(hf), "-i", str(hf), "-o", str(onnx),
           "-p", precision, "-e", "cpu"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = " ".join(done.stderr.split()[-40:])
        raise RuntimeError(f"onnxruntime-genai's model builder failed (exit {done.returncode}): {tail}")
    return onnx


#: q8_0 weights are written too, but llama-cpp-python 0.3.36 as built here (AVX-512, AMX) crashed evaluating
#: them on the tiny model (a segmentation fault inside eval): docs/engines.md.
WEIGHTS = ("f32", "f16", "q8_0")
#: Hugging Face's per-layer tensor names -> llama.cpp's (``blk.N.<name>.weight``).
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Q and K rows reordered from Hugging Face's rotate-half layout to llama.cpp's interleaved pairs (what
    llama.cpp's own converter does)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_gguf_model(out, seed: int = 0, weights: str = "f32") -> Path:
    """Write the tiny random Llama (:func:`tiny_llama`) to ``out/hf`` and, with the
    ``gguf`` package, to ``out/model-{weights}.gguf`` (``weights``: :data:`WEIGHTS`; norms stay float32);
    return the GGUF path."""
    import gguf

    require_choice(weights, "weights", WEIGHTS)
    out = Path(out)
    model = tiny_llama(out / "hf", seed)
    cfg = TINY_LLAMA
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg["hidden_size"] // heads
    path = out / f"model-{weights}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("kvfast tiny llama")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(float(model.config.rms_norm_eps))
    writer.add_file_type({"f32": 0, "f16": 1, "q8_0": 7}[weights])
    vocab = cfg["vocab_size"]
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}".encode() for i in range(vocab)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([3, 3, 2] + [1] * (vocab - 3))  # bos, eos: control; unk; the rest normal
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(2)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    tensors = {
        "token_embd.weight": state["model.embed_tokens.weight"],
        "output_norm.weight": state["model.norm.weight"],
        "output.weight": state["lm_head.weight"],
    }
    for layer in range(cfg["num_hidden_layers"]):
        for hf_name, name in GGUF_NAMES.items():
            w = state[f"model.layers.{layer}.{hf_name}.weight"]
            if name == "attn_q":
                w = _permute(w, heads)
            elif name == "attn_k":
                w = _permute(w, kv_heads)
            tensors[f"blk.{layer}.{name}.weight"] = w
    for name, w in tensors.items():
        if w.ndim == 1 or weights == "f32":
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
        elif weights == "f16":
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float16))
        else:
            q = gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --- vLLM's test models: the tiny Llama, and a hybrid of sliding-window and full-attention layers ---------------

#: :func:`tiny_hybrid_model`'s kinds: the transformers config and model class of each.
HYBRID_KINDS = {"gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"), "gemma2": ("Gemma2Config", "Gemma2ForCausalLM")}


def tiny_vllm_model(out, seed: int = 0, positions: int | None = None) -> Path:
    """The tiny random Llama (:func:`tiny_llama`: hidden 128, 4 query heads of 32 over 2 key-value heads, which
    vLLM's CPU attention takes) written to ``out`` (a directory), with ``positions`` positions if given (its config's
    ``max_position_embeddings``: a long-context model, the same weights); returns ``out``."""
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


# --- a tiny TransformerLens model ------------------------------------------------------------------------------

#: TransformerLens's positional kinds the tests build (``positional_embedding_type``).
POSITIONALS = ("standard", "rotary", "alibi")
#: A tiny TransformerLens config (fields of ``HookedTransformerConfig``; ``positional_embedding_type`` and ``dtype``
#: added by :func:`tiny_tl_config`).
TINY_TL = {
    "n_layers": 2, "d_model": 32, "n_ctx": 96, "d_head": 8, "n_heads": 4, "d_mlp": 64, "d_vocab": 61,
    "act_fn": "gelu_new", "normalization_type": "LN",
}  # fmt: skip


def tiny_tl_config(positional: str = "standard", dtype: str = "float32") -> dict:
    """:data:`TINY_TL` with ``positional`` (:data:`POSITIONALS`; rotary over every head dimension) and ``dtype`` (by
    name), as a config file holds it."""
    from kvfast.check.engines.transformer_lens import DTYPES as TL_DTYPES

    require_choice(positional, "positional", POSITIONALS)
    require_choice(dtype, "dtype", TL_DTYPES)
    rotary = {"rotary_dim": TINY_TL["d_head"]} if positional == "rotary" else {}
    return {**TINY_TL, "positional_embedding_type": positional, "dtype": dtype, **rotary}


def tiny_tl_model(positional: str = "standard", dtype: str = "float32", seed: int = 0):
    """A tiny random ``HookedTransformer`` (:func:`tiny_tl_config`), weights from ``seed``."""
    from kvfast.check.engines.transformer_lens import model_from_fields

    return model_from_fields(tiny_tl_config(positional, dtype), seed).eval()
