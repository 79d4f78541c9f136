"""onnxruntime-genai models as models under test: ``ORTModel(path)`` (extra ``kvfast[ort]``).

An onnxruntime-genai model directory (``genai_config.json`` and its ONNX decoder, as
``python -m onnxruntime_genai.models.builder`` writes it) behind the check protocol
(:mod:`kvfast.check.protocol`)::

    report = kvfast.check_cache(ORTModel("path/to/model"), prompt=[1, 2, 3], steps=64, mode="control")

What the adapter does:

- ``prefill(tokens)``: a fresh ``onnxruntime_genai.Generator``, then ``append_tokens``; its logits
  are ``get_output("logits")``. ``extend``/``decode``: ``append_tokens`` on the same generator, so the
  cached path is the engine's own (its KV buffers, its attention kernels, its position handling).
- ``recompute(tokens)``: a plain ``onnxruntime.InferenceSession`` over the same ``model.onnx`` with an
  empty past (every ``past_key_values.*`` input of length 0): the same graph, no cache.
- ``crop(n)`` (rollback): the generator's ``rewind_to(n)``.
- ``recompute_variants``: ``"batch"`` (a batch of two copies of the sequence) and ``"no-opt"`` (a session
  with graph optimisations off: other fused kernels, other summation orders), and ``"transformers"`` (the
  same weights recomputed by a transformers model, a cross-implementation variant) when ``hf_model`` is
  given. None goes through a cache.
- ``internal_formats``: the KV cache's format and the compute format, read from the graph's
  ``past_key_values`` inputs and ``logits`` output (``{"kv cache": "float32", "compute": "float32"}``).
- ``promote``: none (onnxruntime has no float64 decoder); a float32 model already checks in float32.

:data:`ORT_BUGS` are cache bugs injected into the cached path only, for kvfast's tests and scoring.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from kvfast.validation import import_extra, not_allowed, require_choice, require_int

VARIANTS = ("batch", "no-opt", "transformers")
ORT_BUGS: dict[str, str] = {
    "rewind": "crop(n) rewinds one position too few (rewind_to(n + 1)): the cache keeps a token it should drop",
    "evict": "decode drops the oldest token once the sequence passes ORT_WINDOW tokens (rewind and replay)",
}
ORT_WINDOW = 8
#: onnxruntime's tensor type names -> kvfast's format names.
ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(bfloat16)": "bfloat16",
             "tensor(double)": "float64"}  # fmt: skip
MODEL = "an onnxruntime-genai model directory (genai_config.json and its model.onnx)"


def _modules():
    what = "an onnxruntime-genai model"
    return import_extra("onnxruntime", what, "ort"), import_extra("onnxruntime_genai", what, "ort")


def is_ort_model(model: object) -> bool:
    """Whether ``model`` is a path to a directory with ``genai_config.json`` (imports nothing)."""
    return isinstance(model, str | os.PathLike) and (Path(model) / "genai_config.json").is_file()


class ORTModel:
    """An onnxruntime-genai model directory behind the check protocol (see the module doc).

    - ``path``: the model directory.
    - ``variants``: a subset of :data:`VARIANTS` (``"transformers"`` only with ``hf_model``); default: all
      of them that ``hf_model`` allows.
    - ``hf_model``: the same weights as a transformers causal LM (or its directory), for the
      cross-implementation variant.
    - ``bug``: a cache bug from :data:`ORT_BUGS` injected into the cached path.
    """

    def __init__(self, path, *, variants=None, hf_model=None, bug: str | None = None) -> None:
        ort, og = _modules()
        if not is_ort_model(path):
            raise not_allowed("path", path, MODEL)
        self.path = Path(path)
        config = json.loads((self.path / "genai_config.json").read_text())["model"]
        decoder = config["decoder"]
        if variants is None:  # every variant the model can offer: the cross-implementation one with hf_model
            variants = ("batch", "no-opt") if hf_model is None else VARIANTS
        if isinstance(variants, str):
            variants = (variants,)
        self.variants = tuple(require_choice(v, "variants", VARIANTS) for v in variants)
        if "transformers" in self.variants and hf_model is None:
            raise not_allowed("variants", "transformers", "a variant of VARIANTS; 'transformers' needs hf_model")
        if bug is not None:
            require_choice(bug, "bug", ORT_BUGS)
        self.bug = bug
        self.vocab_size = require_int(config.get("vocab_size"), "genai_config.vocab_size", 1)
        self.max_positions = require_int(config.get("context_length"), "genai_config.context_length", 1)
        self.og_model = og.Model(str(self.path))
        self.session = self._session(ort, optimize=True)
        self.past = [i for i in self.session.get_inputs() if i.name.startswith("past_key_values")]
        self.kv_heads = int(decoder["num_key_value_heads"])
        self.head_size = int(decoder["head_size"])
        kv = ORT_TYPES.get(self.past[0].type, "float32") if self.past else "float32"
        logits = next(o for o in self.session.get_outputs() if o.name == "logits")
        self.internal_formats = {"kv cache": kv, "compute": ORT_TYPES.get(logits.type, "float32")}
        self.hf_model = hf_model
        self._sessions: dict[str, object] = {}
        self.skipped_variants: dict[str, str] = {}
        self.generator = None
        self.length = 0

    def __repr__(self) -> str:
        bug = "" if self.bug is None else f", bug={self.bug!r}"
        return f"ORTModel({str(self.path)!r}{bug})"

    def _session(self, ort, optimize: bool):
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1  # one order per kernel, whatever the machine
        if not optimize:
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        return ort.InferenceSession(str(self.path / "model.onnx"), options, providers=["CPUExecutionProvider"])

    # --- the recompute: a plain session, an empty past ------------------------------------------------

    def _run(self, session, tokens, batch: int = 1) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.shape[0] > self.max_positions:
            raise not_allowed(
                "positions", tokens.shape[0], f"at most {self.max_positions} (genai_config.context_length)"
            )
        feeds = {
            "input_ids": np.repeat(tokens[None, :], batch, 0),
            "attention_mask": np.ones((batch, tokens.shape[0]), np.int64),
        }
        dtype = np.float16 if self.internal_formats["kv cache"] == "float16" else np.float32
        for past in self.past:
            feeds[past.name] = np.zeros((batch, self.kv_heads, 0, self.head_size), dtype)
        return session.run(["logits"], feeds)[0]

    def recompute(self, tokens):
        """Logits ``(T, V)`` of the graph over ``tokens`` with an empty past."""
        return self._run(self.session, tokens)[0]

    # --- the cached path: the engine's own generator ---------------------------------------------------

    def _append(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int32).reshape(1, -1)
        if self.length + tokens.shape[1] > self.max_positions:
            raise not_allowed("positions", self.length + tokens.shape[1], f"at most {self.max_positions}")
        self.generator.append_tokens(tokens)
        self.length += tokens.shape[1]
        return np.array(self.generator.get_output("logits"))[0]

    def prefill(self, tokens):
        """A fresh generator fed ``tokens``; their logits ``(T, V)``."""
        _, og = _modules()
        params = og.GeneratorParams(self.og_model)
        params.set_search_options(max_length=self.max_positions)
        self.generator, self.length = og.Generator(self.og_model, params), 0
        self.tokens: list[int] = []
        out = self._append(tokens)
        self.tokens += [int(t) for t in np.asarray(tokens).reshape(-1)]
        return out

    def extend(self, tokens):
        """``tokens`` appended to the generator; their logits ``(n, V)``."""
        self._require()
        out = self._append(tokens)
        self.tokens += [int(t) for t in np.asarray(tokens).reshape(-1)]
        return out

    def decode(self, token):
        """One token appended; logits ``(V,)``."""
        self._require()
        token = require_int(token, "token", 0, self.vocab_size - 1)
        if self.bug == "evict" and self.length >= ORT_WINDOW:
            # the injected eviction: drop the oldest token by rebuilding the generator over the last tokens
            keep = self.tokens[-(ORT_WINDOW - 1) :]
            self.prefill(keep)
        out = self._append([token])[0]
        self.tokens.append(token)
        return out

    def crop(self, n: int) -> None:
        """Roll the cache back to its first ``n`` positions (``rewind_to``)."""
        self._require()
        n = require_int(n, "n", 0, self.length)
        target = min(n + 1, self.length) if self.bug == "rewind" else n
        self.generator.rewind_to(target)
        self.length = target
        self.tokens = self.tokens[:target]

    def _require(self) -> None:
        if self.generator is None:
            raise ValueError("cache: empty; allowed: call prefill(tokens) first")

    # --- order noise ---------------------------------------------------------------------------------

    def recompute_variants(self, tokens) -> dict:
        """Recomputes of ``tokens`` that differ from :meth:`recompute` only in how they add up (no cache); a
        variant that cannot run is left out and named in :attr:`skipped_variants`."""
        ort, _ = _modules()
        out = {}
        for name in self.variants:
            if name in self.skipped_variants:
                continue
            try:
                if name == "batch":
                    out[name] = self._run(self.session, tokens, batch=2)[1]
                elif name == "no-opt":
                    if name not in self._sessions:
                        self._sessions[name] = self._session(ort, optimize=False)
                    out[name] = self._run(self._sessions[name], tokens)[0]
                else:
                    out[name] = self._transformers(tokens)
            except Exception as exc:  # noqa: BLE001 - a variant is order noise: losing one must not lose the check
                self.skipped_variants[name] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        return out

    def _transformers(self, tokens) -> np.ndarray:
        import torch

        model = self.hf_model
        if isinstance(model, str | os.PathLike):
            from transformers import AutoModelForCausalLM

            model = self.hf_model = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
        ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))[None, :]
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False).logits[0].float().numpy()


# --- tiny random test models (no download) -------------------------------------------------------------

PRECISIONS = ("fp32", "fp16", "int4")


def tiny_ort_model(out, seed: int = 0, precision: str = "fp32") -> Path:
    """Build a tiny random Llama (:func:`kvfast.check.engines.tiny.tiny_llama`) in ``out/hf`` and convert it
    with onnxruntime-genai's model builder into ``out/onnx`` (``precision``: :data:`PRECISIONS`, CPU);
    return ``out/onnx``. Nothing is downloaded; about 10 s."""
    import subprocess
    import sys

    from kvfast.check.engines.tiny import tiny_llama

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
