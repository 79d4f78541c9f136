"""onnxruntime-genai models as models under test: ``ORTModel(path | onnxruntime_genai.Model)`` (``kvfast[ort]``).

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
- ``recompute_variants``, the engine's own order noise (no outside weights needed): ``"batch"`` (a batch of
  two copies of the sequence), ``"no-opt"`` (a session with graph optimisations off: other fused kernels),
  ``"chunk"`` (prefill chunking: the sequence fed one token at a time through the plain session, each run's
  ``present`` keys and values handed back as the next run's past by kvfast itself), ``"threads"`` (a session
  with :data:`VARIANT_THREADS` intra-op threads; not a default: see :data:`DEFAULT_VARIANTS`); and
  ``"transformers"`` (the same weights recomputed by a transformers model, a cross-implementation variant)
  when ``hf_model`` is given. Each is admitted as noise only within what the declared formats' rounding can
  produce (:func:`kvfast.check.formats.admission`).

  Why ``"chunk"``: onnxruntime's recompute is append-invariant and its batch, thread and optimisation
  variants are bit-identical to it (measured: 0 relative on fp32 builds), so without it a correct fp32 engine
  had no noise but one float32 unit and was ``inconclusive`` (its decode lands up to 7 units from the
  recompute). What differs is the one-row product: a chunk of one row takes other kernels (matrix-vector,
  attention over a past) than a chunk of two or more, whose rows equal the recompute's bit for bit. The chunk
  variant's past is plain arrays kvfast passes from run to run, never the generator's buffers: a bug of the
  engine's cache handling (positions, the shared past-present buffer, ``rewind_to``, eviction) cannot reach
  it; a bug inside the graph's attention over a past would, and it then moves the variant off the recompute
  by more than rounding can, so the variant is refused and the cached path judged without it.
- ``internal_formats``: the KV cache's format and the compute format, read from the graph's
  ``past_key_values`` inputs and ``logits`` output (``{"kv cache": "float32", "compute": "float32"}``),
  and, for a quantized build (int8, int4: ``MatMulNBits`` nodes), ``"activations": "int8"`` where a node's
  ``accuracy_level`` is 4: onnxruntime's CPU kernel then rounds each row of the node's input to int8 in
  blocks of ``block_size`` along the inner dimension (:func:`fake_quantize_int8_blocks`) before an integer
  dot product. The weights' own format is not declared: see :func:`quantized_formats`.
- quantized builds: the ``transformers`` variant loads ``hf_model`` with the build's own weights,
  dequantized from the ``MatMulNBits`` initializers (:func:`dequantize_matmulnbits`), and rounds the
  inputs of those layers to int8 as the engine does (:func:`dequantized_transformers`), so it computes
  the engine's function, not the float32 model the build was quantized from.
- ``promote``: the model itself (onnxruntime-genai has no float64 decoder): the logic check runs in the
  build's own format, and the report says so.

Cache bugs for kvfast's tests and scoring are injected into the cached path by subclassing this adapter
(:data:`kvfast.bugs.engine_bugs.ORT_BUGS`, over the hooks :meth:`ORTModel._crop_keep` and ``decode``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kvfast.check.engines import FedCache, choose_variants, run_variants
from kvfast.validation import import_extra, not_allowed, require_choice, require_int

VARIANTS = ("batch", "no-opt", "chunk", "threads", "transformers")
#: The variants an ``ORTModel`` computes unless told otherwise (``"transformers"`` added with ``hf_model``):
#: ``"threads"`` is left out: measured bit-identical to the recompute on onnxruntime's CPU kernels (they split a
#: product's rows and columns among threads, never its sums), it gives no draw for the cost of a session.
DEFAULT_VARIANTS = ("batch", "no-opt", "chunk")
#: The variants of an ``onnxruntime_genai.Model`` object: it does not say where its graph is, so there is no plain
#: session (``no-opt``, ``threads``); each runs in a fresh generator of its own.
MODEL_VARIANTS = ("batch", "chunk")
#: The intra-op thread count of the ``"threads"`` variant's session (the recompute's is 1).
VARIANT_THREADS = 4
#: onnxruntime's tensor type names -> kvfast's format names.
ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(bfloat16)": "bfloat16",
             "tensor(double)": "float64"}  # fmt: skip
MODEL = "an onnxruntime-genai model directory (genai_config.json and its model.onnx) or an onnxruntime_genai.Model"


def _presents(decoder: dict) -> dict[str, str]:
    """``{past input: present output}`` of every layer's key and value, from the decoder's ``genai_config`` names
    (``past_key_values.%d.key`` -> ``present.%d.key``, the builder's defaults where a name is not given)."""
    inputs, outputs = decoder.get("inputs", {}), decoder.get("outputs", {})
    out = {}
    for kind in ("key", "value"):
        past = inputs.get(f"past_{kind}_names", f"past_key_values.%d.{kind}")
        present = outputs.get(f"present_{kind}_names", f"present.%d.{kind}")
        for layer in range(int(decoder["num_hidden_layers"])):
            out[past % layer] = present % layer
    return out


def _modules():
    what = "an onnxruntime-genai model"
    return import_extra("onnxruntime", what, "ort"), import_extra("onnxruntime_genai", what, "ort")


def is_og_model(model: object) -> bool:
    """Whether ``model`` is an ``onnxruntime_genai.Model`` (imports nothing)."""
    return type(model).__name__ == "Model" and type(model).__module__.startswith("onnxruntime_genai")


def is_ort_model(model: object) -> bool:
    """Whether ``model`` is a path to a directory with ``genai_config.json`` (imports nothing)."""
    return isinstance(model, str | os.PathLike) and (Path(model) / "genai_config.json").is_file()


class ORTModel(FedCache):
    """An onnxruntime-genai model behind the check protocol (see the module doc).

    - ``path``: the model directory, or an ``onnxruntime_genai.Model`` as a user has it (it does not say where
      its files are: the recompute and the variants then run in fresh generators of it, see
      :data:`MODEL_VARIANTS`, and a quantized build's int8 activations cannot be read, so pass the directory
      for those).
    - ``variants``: a subset of :data:`VARIANTS` (``"transformers"`` only with ``hf_model``); default: the
      engine's own (:data:`DEFAULT_VARIANTS`, :data:`MODEL_VARIANTS` for a ``Model``), and ``"transformers"``
      with ``hf_model``.
    - ``hf_model``: the same weights as a transformers causal LM (or its directory), for the
      cross-implementation variant; for a quantized build, the model it was built from: the variant computes
      with a copy holding the build's own weights, dequantized (:func:`dequantized_transformers`).
    """

    def __init__(self, path, *, variants=None, hf_model=None) -> None:
        ort, og = _modules()
        loaded = is_og_model(path)
        if not loaded and not is_ort_model(path):
            raise not_allowed("path", path, MODEL)
        own = DEFAULT_VARIANTS if not loaded else MODEL_VARIANTS
        if variants is None:  # the engine's own variants, and the cross-implementation one with hf_model
            variants = own if hf_model is None else (*own, "transformers")
        self.variants = choose_variants(variants, VARIANTS)
        if "transformers" in self.variants and hf_model is None:
            raise not_allowed("variants", "transformers", "a variant of VARIANTS; 'transformers' needs hf_model")
        needs_file = [v for v in self.variants if v not in (*MODEL_VARIANTS, "transformers")]
        if loaded and needs_file:
            allowed = f"{', '.join(MODEL_VARIANTS)}, transformers for an onnxruntime_genai.Model (no file: no session)"
            raise not_allowed("variants", needs_file[0], allowed)
        self.hf_model = hf_model
        self._sessions: dict[str, object] = {}
        self.skipped_variants: dict[str, str] = {}
        self.generator = None
        self.length = 0
        if loaded:
            self._from_loaded(path)
        else:
            self._from_directory(ort, og, Path(path))

    def _from_loaded(self, og_model) -> None:
        """An ``onnxruntime_genai.Model`` (it does not say where it was loaded from): everything through generators
        of it. The formats are read from its outputs: the logits' and the first layer's ``present`` key's."""
        _, og = _modules()
        self.og_model, self.path, self.session, self.quantized = og_model, None, None, []
        self.max_positions = int(og.GeneratorParams(og_model).get_search_options()["max_length"])
        generator = self._generator(1, 2)
        generator.append_tokens(np.zeros((1, 1), np.int32))
        logits = np.array(generator.get_output("logits"))
        self.vocab_size = int(logits.shape[-1])
        fmt = str(logits.dtype) if str(logits.dtype) in ("float16", "float32") else "float32"
        try:
            kv = str(np.array(generator.get_output("present.0.key")).dtype)
        except Exception:  # noqa: BLE001 - another output naming: the logits' format stands for the cache's
            kv = fmt
        self.internal_formats = {"kv cache": kv if kv in ("float16", "float32") else fmt, "compute": fmt}

    def _from_directory(self, ort, og, path: Path) -> None:
        """A model directory: the generator's model, a plain session, the formats read from the graph."""
        self.path = path
        config = json.loads((self.path / "genai_config.json").read_text())["model"]
        decoder = config["decoder"]
        self.vocab_size = require_int(config.get("vocab_size"), "genai_config.vocab_size", 1)
        self.max_positions = require_int(config.get("context_length"), "genai_config.context_length", 1)
        self.og_model = og.Model(str(self.path))
        self.session = self._session(ort, optimize=True)
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.presents = _presents(decoder)
        self.takes_positions = decoder.get("inputs", {}).get("position_ids", "position_ids") in inputs
        self.kv_heads = int(decoder["num_key_value_heads"])
        self.head_size = int(decoder["head_size"])
        first = inputs.get(next(iter(self.presents), ""))
        kv = ORT_TYPES.get(first.type, "float32") if first is not None else "float32"
        self.past_dtype = np.float16 if kv == "float16" else np.float32  # the graph's past inputs
        logits = next(o for o in self.session.get_outputs() if o.name == "logits")
        self.internal_formats = {"kv cache": kv, "compute": ORT_TYPES.get(logits.type, "float32")}
        self.quantized = quantized_matmuls(self.path / "model.onnx", weights=False)
        self.internal_formats.update(quantized_formats(self.quantized))

    def __repr__(self) -> str:
        where = "onnxruntime_genai.Model" if self.path is None else str(self.path)
        return f"ORTModel({where!r})"

    def _generator(self, batch: int = 1, max_length: int | None = None):
        """A fresh generator of the model (``batch`` sequences, room for ``max_length`` positions)."""
        _, og = _modules()
        params = og.GeneratorParams(self.og_model)
        params.set_search_options(batch_size=batch, max_length=max_length or self.max_positions)
        return og.Generator(self.og_model, params)

    def _generate(self, tokens, batch: int = 1, chunk: int | None = None) -> np.ndarray:
        """Logits ``(batch, T, V)`` of a fresh generator fed ``batch`` copies of ``tokens`` at once (nothing cached
        before them) or, with ``chunk``, ``chunk`` tokens at a time (the engine's own cache between chunks, in a
        generator of its own: never the one under test)."""
        ids = np.repeat(np.asarray(tokens, dtype=np.int32).reshape(1, -1), batch, 0)
        if ids.shape[1] > self.max_positions:
            raise not_allowed("positions", ids.shape[1], f"at most {self.max_positions} (the model's max_length)")
        generator, rows = self._generator(batch, ids.shape[1]), []
        for start in range(0, ids.shape[1], chunk or ids.shape[1]):
            generator.append_tokens(ids[:, start : start + (chunk or ids.shape[1])])
            rows.append(np.array(generator.get_output("logits")))
        return np.concatenate(rows, axis=1)

    def _session(self, ort, optimize: bool, threads: int = 1):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads  # 1: one order per kernel, whatever the machine
        if not optimize:
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        return ort.InferenceSession(str(self.path / "model.onnx"), options, providers=["CPUExecutionProvider"])

    # --- the recompute: a plain session, an empty past ------------------------------------------------

    def _feeds(self, ids: np.ndarray, past: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The graph's inputs for ``ids`` ``(batch, n)`` after ``past`` (``{past input: (batch, heads, start,
        head size)}``): the attention mask over every position so far and, where the graph takes them, the
        positions ``start .. start + n - 1``."""
        batch, n = ids.shape
        start = next(iter(past.values())).shape[2] if past else 0
        if start + n > self.max_positions:
            raise not_allowed("positions", start + n, f"at most {self.max_positions} (genai_config.context_length)")
        feeds = {"input_ids": ids, "attention_mask": np.ones((batch, start + n), np.int64), **past}
        if self.takes_positions:
            feeds["position_ids"] = np.repeat(np.arange(start, start + n, dtype=np.int64)[None, :], batch, 0)
        return feeds

    def _empty_past(self, batch: int) -> dict[str, np.ndarray]:
        return {name: np.zeros((batch, self.kv_heads, 0, self.head_size), self.past_dtype) for name in self.presents}

    def _run(self, session, tokens, batch: int = 1, chunk: int | None = None) -> np.ndarray:
        """Logits ``(batch, T, V)`` of ``session`` over ``batch`` copies of ``tokens`` after an empty past, all at once
        or, with ``chunk``, ``chunk`` tokens a run, each run's ``present`` keys and values handed back as the next
        run's past by kvfast (plain arrays: never the generator's buffers)."""
        ids = np.repeat(np.asarray(tokens, dtype=np.int64).reshape(1, -1), batch, 0)
        past, rows = self._empty_past(batch), []
        names = ["logits", *self.presents.values()]
        for start in range(0, ids.shape[1], chunk or ids.shape[1]):
            out = session.run(names, self._feeds(ids[:, start : start + (chunk or ids.shape[1])], past))
            rows.append(out[0])
            past = dict(zip(self.presents, out[1:], strict=True))
        return np.concatenate(rows, axis=1)

    def recompute(self, tokens):
        """Logits ``(T, V)`` of the graph over ``tokens`` with an empty past (a plain session; for an
        ``onnxruntime_genai.Model``, a fresh generator's prefill: measured equal to the session bit for bit)."""
        return self._run(self.session, tokens)[0] if self.session is not None else self._generate(tokens)[0]

    # --- the cached path: the engine's own generator ---------------------------------------------------

    def _fresh(self) -> None:
        self.generator, self.length = self._generator(), 0

    def _feed(self, tokens: list[int]) -> np.ndarray:
        """``tokens`` appended to the generator; their logits ``(n, V)``."""
        if self.length + len(tokens) > self.max_positions:
            raise not_allowed("positions", self.length + len(tokens), f"at most {self.max_positions}")
        self.generator.append_tokens(np.asarray(tokens, dtype=np.int32).reshape(1, -1))
        self.length += len(tokens)
        return np.array(self.generator.get_output("logits"))[0]

    def crop(self, n: int) -> None:
        """Roll the cache back to its first ``n`` positions (``rewind_to``)."""
        self._require()
        n = require_int(n, "n", 0, self.length)
        target = self._crop_keep(n)
        self.generator.rewind_to(target)
        self.length = target
        self.tokens = self.tokens[:target]

    def _crop_keep(self, n: int) -> int:
        """Hook: the positions a crop to ``n`` keeps (``n``)."""
        return n

    def promote(self, dtype: str = "float64") -> ORTModel:
        """This same model: onnxruntime-genai has no float64 decoder, so the logic check
        (``check_cache(..., promote="float64")``) runs in the build's own format (float32 for an fp32 build) and
        the report says so (the format it ran in, never a claim of float64)."""
        require_choice(dtype, "promote", ("float64", "float32"))
        return self

    # --- order noise ---------------------------------------------------------------------------------

    def recompute_variants(self, tokens) -> dict:
        """Recomputes of ``tokens`` that differ from :meth:`recompute` only in how they add up (no cache); a
        variant that cannot run is left out and named in :attr:`skipped_variants`."""
        return run_variants(self, self.variants, lambda name: self._variant(name, tokens))

    def _variant(self, name: str, tokens) -> np.ndarray:
        if name in ("batch", "chunk"):  # the plain session, else (an onnxruntime_genai.Model) a fresh generator
            batch, chunk = (2, None) if name == "batch" else (1, 1)
            if self.session is None:
                return self._generate(tokens, batch, chunk)[-1]
            return self._run(self.session, tokens, batch, chunk)[-1]
        if name == "transformers":
            return self._transformers(tokens)
        if name not in self._sessions:  # no-opt, threads
            threads = VARIANT_THREADS if name == "threads" else 1
            self._sessions[name] = self._session(_modules()[0], optimize=name != "no-opt", threads=threads)
        return self._run(self._sessions[name], tokens)[0]

    def _transformers(self, tokens) -> np.ndarray:
        import torch

        model = self.hf_model
        if isinstance(model, str | os.PathLike):
            from transformers import AutoModelForCausalLM

            model = self.hf_model = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
        if self.quantized and not getattr(model, "_kvfast_dequantized", False):
            # the float weights the build was quantized from are another function: give it the build's own
            model = self.hf_model = dequantized_transformers(model, self.path / "model.onnx")
        ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))[None, :]
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False).logits[0].float().numpy()


# --- quantized builds: the MatMulNBits weights, dequantized, and the engine's int8 activations ----------

#: ``MatMulNBits``'s ``accuracy_level`` at which onnxruntime's CPU kernel rounds the input to int8 (the contrib
#: op's spec: 4 = int8 compute). Measured here (onnxruntime 1.32, float32 input): levels 0 to 3 compute in
#: float32 (a few float32 units from the dequantized product), level 4 is ``fake_quantize_int8_blocks`` of the
#: input times the dequantized weight, to a few float32 units (tests/engines/test_engines_ort.py).
INT8_ACCURACY_LEVEL = 4
_WEIGHT_NAME = re.compile(r"^(?P<module>.+)\.MatMul\.weight_Q\d+$")


@dataclass(frozen=True)
class QuantizedMatMul:
    """One ``MatMulNBits`` node of a graph: ``Y = A @ W.T`` with ``W`` ``(n, k)`` stored in ``bits``-bit codes, one
    scale (and zero point) per block of ``block_size`` along ``k``. ``module``: the layer's path in the
    builder's naming (``model.layers.0.attn.qkv_proj``); ``weight``: ``W`` dequantized (float32), or ``None``
    when read without weights."""

    node: str
    module: str
    bits: int
    block_size: int
    k: int
    n: int
    accuracy_level: int
    weight: np.ndarray | None = None


def dequantize_matmulnbits(
    codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, *, bits: int, block_size: int, k: int
) -> np.ndarray:
    """The float weight ``W`` ``(n, k)`` of a ``MatMulNBits`` node, from the contrib op's spec (com.microsoft):

    - ``codes``: uint8 ``(n, blocks, block_size * bits / 8)``, ``blocks = ceil(k / block_size)``, each byte
      holding ``8 / bits`` codes, the lowest bits first;
    - ``scales``: ``(n, blocks)`` (or flat), in the input's float type;
    - ``zero_points``: ``None`` (the default zero point, ``2 ** (bits - 1)``: symmetric) or uint8 packed like
      the codes along the blocks (``(n, ceil(blocks * bits / 8))`` or flat);
    - ``W[j, b * block_size + i] = (code - zero_point[j, b]) * scale[j, b]``, computed in the scales' format
      (the kernel's dequantization: one rounding), the padding past ``k`` dropped.

    ``ValueError`` naming the field for shapes or types outside the spec."""
    if bits not in (2, 4, 8):
        raise not_allowed("bits", bits, "2, 4, 8")
    codes = np.asarray(codes)
    if codes.dtype != np.uint8 or codes.ndim != 3:
        raise not_allowed("codes", f"{codes.dtype} {codes.shape}", "uint8 (n, blocks, block_size * bits / 8)")
    n, blocks, blob = codes.shape
    if blocks != -(-k // block_size) or blob * 8 != block_size * bits:
        raise not_allowed("codes", codes.shape, f"(n, {-(-k // block_size)}, {block_size * bits // 8})")
    scales = np.asarray(scales)
    if scales.dtype.kind != "f" or scales.size != n * blocks:
        raise not_allowed("scales", f"{scales.dtype} {scales.shape}", f"floats, ({n}, {blocks})")
    scales = scales.reshape(n, blocks)
    unpacked = _unpack(codes.reshape(n, blocks * blob), bits).reshape(n, blocks, block_size)
    if zero_points is None:
        zero = np.full((n, blocks, 1), 2 ** (bits - 1), dtype=scales.dtype)
    else:
        zero_points = np.asarray(zero_points)
        per_row = -(-blocks * bits // 8)
        if zero_points.dtype != np.uint8 or zero_points.size != n * per_row:
            raise not_allowed(
                "zero_points", f"{zero_points.dtype} {zero_points.shape}", f"uint8 packed, ({n}, {per_row})"
            )
        zero = _unpack(zero_points.reshape(n, per_row), bits)[:, :blocks, None].astype(scales.dtype)
    weight = (unpacked.astype(scales.dtype) - zero) * scales[:, :, None]
    return weight.reshape(n, blocks * block_size)[:, :k]


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """``(rows, bytes)`` uint8 -> ``(rows, bytes * 8 / bits)`` codes, the lowest bits of each byte first."""
    if bits == 8:
        return packed
    shifts = np.arange(0, 8, bits, dtype=np.uint8)
    return ((packed[:, :, None] >> shifts) & np.uint8(2**bits - 1)).reshape(packed.shape[0], -1)


def quantized_matmuls(onnx_file, *, weights: bool = True) -> list[QuantizedMatMul]:
    """The ``MatMulNBits`` nodes of ``onnx_file`` (empty for a float build), their weights dequantized
    (:func:`dequantize_matmulnbits`) when ``weights``. ``ValueError`` for a node kvfast cannot dequantize
    (float zero points, ``g_idx``, a bias, weights that are not initializers)."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(onnx_file), load_external_data=weights).graph
    nodes = [n for n in graph.node if n.op_type == "MatMulNBits" and n.domain == "com.microsoft"]
    if not nodes:
        return []
    inits = {i.name: i for i in graph.initializer} if weights else {}
    out = []
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        inputs = list(node.input) + [""] * (6 - len(node.input))
        if any(inputs[4:]):
            raise not_allowed(f"{node.name}.inputs", inputs[4:], "no g_idx and no bias (kvfast dequantizes none)")
        found = _WEIGHT_NAME.match(inputs[1])
        module = found["module"] if found else node.name.strip("/").rsplit("/", 1)[0].replace("/", ".")
        q = QuantizedMatMul(node.name, module, int(attrs.get("bits", 4)), int(attrs["block_size"]), int(attrs["K"]),
                            int(attrs["N"]), int(attrs.get("accuracy_level", 0)))  # fmt: skip
        if weights:
            missing = [name for name in inputs[1:4] if name and name not in inits]
            if missing:
                raise not_allowed(f"{node.name}.inputs", missing, "initializers (constant quantized weights)")
            zero = numpy_helper.to_array(inits[inputs[3]]) if inputs[3] else None
            weight = dequantize_matmulnbits(numpy_helper.to_array(inits[inputs[1]]),
                                            numpy_helper.to_array(inits[inputs[2]]), zero, bits=q.bits,
                                            block_size=q.block_size, k=q.k)  # fmt: skip
            q = replace(q, weight=weight)
        out.append(q)
    return out


def quantized_formats(matmuls: list[QuantizedMatMul]) -> dict[str, str]:
    """What a quantized build computes in, for ``internal_formats``: ``{"activations": "int8"}`` when any node
    rounds its input to int8 (``accuracy_level`` :data:`INT8_ACCURACY_LEVEL`), else nothing.

    The weights' int8 (or int4) codes are not a format of the noise model: they are constants, rounded once
    when the model was built, and the cached path and the recompute multiply by the very same dequantized
    values; only a format a computation rounds INTO while it runs (a cache, an activation, a sum) can make two
    orders of the same function land apart. The activations are such a format: a float32 input that differs
    by one float32 unit between the two paths can round to another int8 code (1/127 of its block's largest
    value)."""
    return {"activations": "int8"} if any(q.accuracy_level == INT8_ACCURACY_LEVEL for q in matmuls) else {}


def fake_quantize_int8_blocks(x, block_size: int):
    """``x`` (a float torch tensor) rounded as onnxruntime's CPU ``MatMulNBits`` rounds its input at
    ``accuracy_level`` 4 (MLAS's int8 compute): each row in blocks of ``block_size`` along the last axis,
    per block ``scale = max|x| / 127`` and ``code = round(x * (127 / max|x|))`` (to nearest, ties to even),
    returned as ``code * scale`` (the integer dot product times the scales equals this product's sum up to
    order)."""
    import torch

    k = x.shape[-1]
    pad = (-k) % block_size
    blocks = torch.nn.functional.pad(x, (0, pad)).reshape(*x.shape[:-1], -1, block_size)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inverse).clamp(-127, 127)
    return (codes * (amax / 127.0)).reshape(*x.shape[:-1], -1)[..., :k]


def _hf_parameters(matmul: QuantizedMatMul, config) -> dict[str, np.ndarray]:
    """A node's dequantized weight under transformers' parameter names (Llama family): the builder's ``attn`` is
    ``self_attn``; its fused ``qkv_proj`` splits into ``q_proj``, ``k_proj``, ``v_proj`` by the heads."""
    module = matmul.module.replace(".attn.", ".self_attn.")
    if not module.endswith(".qkv_proj"):
        return {f"{module}.weight": matmul.weight}
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head, config.num_key_value_heads * head
    base = module[: -len("qkv_proj")]
    w = matmul.weight
    if w.shape[0] != q + 2 * kv:
        raise not_allowed(f"{matmul.node}.N", w.shape[0], f"{q + 2 * kv} (q, k, v of the transformers config)")
    return {f"{base}q_proj.weight": w[:q], f"{base}k_proj.weight": w[q : q + kv], f"{base}v_proj.weight": w[q + kv :]}


def dequantized_transformers(hf_model, onnx_file):
    """A copy of ``hf_model`` (a transformers causal LM, float32) computing what the quantized build
    ``onnx_file`` computes, up to order: every ``MatMulNBits`` layer's weight replaced by the build's own,
    dequantized (:func:`quantized_matmuls`), and, for a node at ``accuracy_level`` 4, its input rounded to int8
    the way the engine rounds it (:func:`fake_quantize_int8_blocks`, a forward pre-hook). The other weights
    (embedding, norms) are the model's own: the builder keeps them in float. ``ValueError`` naming the
    parameter when a quantized layer has no counterpart of its shape in ``hf_model``."""
    import copy

    import torch

    model = copy.deepcopy(hf_model).float().eval()
    params = dict(model.named_parameters())
    for matmul in quantized_matmuls(onnx_file):
        for name, weight in _hf_parameters(matmul, model.config).items():
            if name not in params or tuple(params[name].shape) != weight.shape:
                allowed = "a parameter of hf_model with the node's shape (the same architecture as the build)"
                raise not_allowed(f"hf_model.{name}", tuple(weight.shape), allowed)
            with torch.no_grad():
                params[name].copy_(torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32)))
            if matmul.accuracy_level == INT8_ACCURACY_LEVEL:
                layer = model.get_submodule(name.removesuffix(".weight"))
                block = matmul.block_size
                layer.register_forward_pre_hook(lambda _m, args, b=block: (fake_quantize_int8_blocks(args[0], b),))
    model._kvfast_dequantized = True
    return model
