"""llama.cpp models (through llama-cpp-python) as models under test: ``LlamaCppModel(path)`` (extra
``kvfast[llamacpp]``, built from source: see docs/engines.md).

A GGUF file behind the check protocol (:mod:`kvfast.check.protocol`)::

    report = kvfast.check_cache(LlamaCppModel("tiny.gguf", cache="f16"), [1, 2, 3], 64, mode="control")

What the adapter does:

- ``prefill(tokens)``: ``reset()`` then ``eval(tokens)`` on the context under test (``logits_all=True``, one
  thread, a batch as large as the context, so a prompt is one batch); logits from ``scores``.
- ``decode(token)``: ``eval([token])`` on the same context: llama.cpp's own KV cache, in ``cache``'s format
  (``type_k``/``type_v``: ``f16``, the default, ``f32`` or ``q8_0``).
- ``extend(tokens)``: a resumed session: the context's state is saved (``save_state``), loaded into a second
  context (``load_state``), and the chunk is evaluated there; that context is then the one under test.
- ``crop(n)`` (the ``rollback`` scenario; hook :meth:`LlamaCppModel._crop_keep`): keep the first ``n``
  positions (``n_tokens = n``; the next ``eval`` removes the rest from the KV cache, as llama-cpp-python's own
  prefix reuse does).
- ``snapshot()``/``restore(state)`` (the ``fork`` scenario): ``save_state``/``load_state``.
- ``recompute(tokens)``: a third context, ``reset()`` then ``eval`` of the whole sequence in one batch.
- ``recompute_variants``: ``"transformers"`` (the same weights recomputed by a transformers model, a
  cross-implementation variant) when ``hf_model`` is given.
- ``internal_formats``: the KV cache's format (``float16``, ``float32``, ``int8`` for ``q8_0``) and the
  activations' (:data:`ACTIVATIONS`: ``float16`` for float16 weights, ``int8`` for ``q8_0``: ggml rounds a
  matrix product's input to its weights' kind).
- ``promote(dtype)``: the same model with a float32 KV cache (llama.cpp has no float64): the logic check runs
  in float32 and says so.

Cache bugs for kvfast's tests and scoring are injected into the cached path by subclassing this adapter
(:data:`kvfast.bugs.engines.LLAMACPP_BUGS`, over the hooks :meth:`LlamaCppModel._crop_keep` and ``decode``).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from kvfast.validation import import_extra, not_allowed, require_choice, require_int

CACHE_TYPES = {"f16": "float16", "f32": "float32", "q8_0": "int8"}
#: The format a matrix product's input is rounded to, by the weights' file type (``general.file_type``):
#: ggml converts the activations to float16 for float16 weights (1) and quantises them to 8 bits for q8_0 (7).
ACTIVATIONS = {"1": "float16", "7": "int8"}
MODEL = "a GGUF file path or a llama_cpp.Llama"


#: ggml's type numbers (``ggml_type``, stable in its ABI) -> :data:`CACHE_TYPES`' keys: a ``Llama``'s KV cache type.
GGML_TYPES = {0: "f32", 1: "f16", 8: "q8_0"}


def is_llama(model: object) -> bool:
    """Whether ``model`` is a ``llama_cpp.Llama`` (imports nothing)."""
    return type(model).__name__ == "Llama" and type(model).__module__.startswith("llama_cpp")


def llama_settings(llm) -> dict:
    """What kvfast reads from a ``llama_cpp.Llama`` to check its model: ``{"path": its GGUF file (model_path),
    "cache": its KV cache type (context_params.type_k, a key of CACHE_TYPES), "n_ctx": its context length}``.
    ``ValueError`` naming the field for a cache type kvfast does not know."""
    kind = int(llm.context_params.type_k)
    if kind not in GGML_TYPES:
        raise not_allowed("model.context_params.type_k", kind, ", ".join(f"{k} ({v})" for k, v in GGML_TYPES.items()))
    return {"path": llm.model_path, "cache": GGML_TYPES[kind], "n_ctx": int(llm.n_ctx())}


def _llama_cpp():
    return import_extra("llama_cpp", "a llama.cpp model", "llamacpp")


class LlamaCppModel:
    """A GGUF model behind the check protocol through llama-cpp-python (see the module doc).

    - ``path``: the GGUF file, or a ``llama_cpp.Llama``: its file, KV cache type and context length are read
      from it (:func:`llama_settings`; ``cache`` and ``n_ctx`` then come from the object) and kvfast runs its
      own contexts of that file (every row's logits need ``logits_all``, one thread, one batch per prompt).
    - ``cache``: the KV cache type, a key of :data:`CACHE_TYPES`.
    - ``hf_model``: the same weights as a transformers causal LM (or its directory), for the
      cross-implementation variant.
    - ``n_ctx``: the context length of every context (default 256).
    """

    def __init__(self, path, *, cache: str = "f16", hf_model=None, n_ctx: int = 256):
        if is_llama(path):
            settings = llama_settings(path)
            path, cache, n_ctx = settings["path"], settings["cache"], settings["n_ctx"]
        if not isinstance(path, str | os.PathLike) or not Path(path).is_file():
            raise not_allowed("path", path, MODEL)
        self.cache_type = require_choice(cache, "cache", CACHE_TYPES)
        self.path, self.hf_model = Path(path), hf_model
        self.max_positions = require_int(n_ctx, "n_ctx", 2)
        self.variants = ("transformers",) if hf_model is not None else ()
        self.skipped_variants: dict[str, str] = {}
        self.llm = self._context()
        self._spare = None
        self._reference = None
        self.vocab_size = int(self.llm.n_vocab())
        self.internal_formats = {"kv cache": CACHE_TYPES[self.cache_type]}
        activations = ACTIVATIONS.get(str(self.llm.metadata.get("general.file_type", "")))
        if activations is not None:
            self.internal_formats["activations"] = activations
        self.tokens: list[int] = []

    def __repr__(self) -> str:
        return f"LlamaCppModel({str(self.path)!r}, cache={self.cache_type!r})"

    def _context(self):
        llama_cpp = _llama_cpp()
        ggml = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32, "q8_0": llama_cpp.GGML_TYPE_Q8_0}
        n = self.max_positions
        return llama_cpp.Llama(
            str(self.path), n_ctx=n, n_batch=n, n_ubatch=n, logits_all=True, n_threads=1, n_threads_batch=1,
            type_k=ggml[self.cache_type], type_v=ggml[self.cache_type], verbose=False,
            flash_attn=self.cache_type == "q8_0",  # llama.cpp quantises the V cache only under flash attention
        )  # fmt: skip

    def _eval(self, llm, tokens) -> np.ndarray:
        tokens = [int(t) for t in np.asarray(tokens).reshape(-1)]
        start = llm.n_tokens
        if start + len(tokens) > self.max_positions:
            raise not_allowed("positions", start + len(tokens), f"at most {self.max_positions} (n_ctx)")
        llm.eval(tokens)
        return np.array(llm.scores[start : start + len(tokens)], dtype=np.float32)

    def recompute(self, tokens):
        """Logits ``(T, V)`` of ``tokens`` in one batch on a fresh context (nothing cached before)."""
        if self._reference is None:
            self._reference = self._context()
        self._reference.reset()
        return self._eval(self._reference, tokens)

    def prefill(self, tokens):
        """``reset()`` and ``eval(tokens)`` on the context under test; their logits ``(T, V)``."""
        self.llm.reset()
        self.tokens = [int(t) for t in np.asarray(tokens).reshape(-1)]
        return self._eval(self.llm, tokens)

    def extend(self, tokens):
        """A resumed session: the state saved, loaded into a second context, ``tokens`` evaluated there."""
        self._require()
        state = self.llm.save_state()
        if self._spare is None:
            self._spare = self._context()
        self._spare.load_state(state)
        self.llm, self._spare = self._spare, self.llm
        self.tokens += [int(t) for t in np.asarray(tokens).reshape(-1)]
        return self._eval(self.llm, tokens)

    def decode(self, token):
        """``eval([token])`` on the context under test; logits ``(V,)``."""
        self._require()
        token = require_int(token, "token", 0, self.vocab_size - 1)
        self.tokens.append(token)
        return self._eval(self.llm, [token])[0]

    def crop(self, n: int) -> None:
        """Keep the first ``n`` positions of the cache."""
        self._require()
        n = require_int(n, "n", 0, self.llm.n_tokens)
        keep = self._crop_keep(n)
        self.llm.n_tokens = keep
        self.tokens = self.tokens[:keep]

    def _crop_keep(self, n: int) -> int:
        """Hook: the positions a crop to ``n`` keeps (``n``)."""
        return n

    @property
    def length(self) -> int:
        """The positions the cache under test holds."""
        return int(self.llm.n_tokens)

    def snapshot(self):
        """The cache as it is now (``save_state``, and the tokens it holds): the ``fork`` scenario."""
        self._require()
        return self.llm.save_state(), list(self.tokens)

    def restore(self, state) -> None:
        """The cache set back to a :meth:`snapshot` (``load_state``; a state may be restored more than once)."""
        saved, tokens = state
        self.llm.load_state(saved)
        self.tokens = list(tokens)

    def _require(self) -> None:
        if self.llm.n_tokens == 0 and not self.tokens:
            raise ValueError("cache: empty; allowed: call prefill(tokens) first")

    def recompute_variants(self, tokens) -> dict:
        """The cross-implementation variant (with ``hf_model``); a variant that cannot run is left out and
        named in :attr:`skipped_variants`."""
        if not self.variants or "transformers" in self.skipped_variants:
            return {}
        try:
            import torch

            model = self.hf_model
            if isinstance(model, str | os.PathLike):
                from transformers import AutoModelForCausalLM

                model = self.hf_model = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
            ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))[None, :]
            with torch.no_grad():
                return {"transformers": model(input_ids=ids, use_cache=False).logits[0].float().numpy()}
        except Exception as exc:  # noqa: BLE001 - a variant is order noise: losing one must not lose the check
            self.skipped_variants["transformers"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            return {}

    def promote(self, dtype: str = "float64") -> LlamaCppModel:
        """The same model (an injected bug included: the same class) with a float32 KV cache: the best precision
        llama.cpp offers."""
        return type(self)(self.path, cache="f32", hf_model=self.hf_model, n_ctx=self.max_positions)


# --- tiny random GGUF files (no download) ---------------------------------------------------------------

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
    """Write the tiny random Llama (:func:`kvfast.check.engines.tiny.tiny_llama`) to ``out/hf`` and, with the
    ``gguf`` package, to ``out/model-{weights}.gguf`` (``weights``: :data:`WEIGHTS`; norms stay float32);
    return the GGUF path."""
    import gguf

    from kvfast.check.engines.tiny import TINY_LLAMA, tiny_llama

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
