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
(:data:`kvfast.bugs.engine_bugs.LLAMACPP_BUGS`, over the hooks :meth:`LlamaCppModel._crop_keep` and ``decode``).
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
