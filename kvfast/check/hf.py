"""Hugging Face causal LMs as models under test: ``HFModel(model)`` (extra ``kvfast[hf]``).

:func:`kvfast.check_cache` and the ``kv_check`` fixture wrap a transformers
model in :class:`HFModel` themselves, so checking one is one line::

    report = kvfast.check_cache(model, prompt=[1, 2, 3], steps=64, mode="control")

What the adapter does (:mod:`kvfast.check.protocol` for the methods):

- ``recompute(tokens)``: ``model(ids, use_cache=False).logits[0]``.
- ``prefill(tokens)``: a FRESH cache (``DynamicCache``, or ``new_cache()`` such
  as a ``StaticCache``; some releases update a cache in place, so one is never
  reused), then ``model(ids, cache=..., use_cache=True)``. A model that takes no
  cache object (``_supports_cache_class = False``: 4.3x GPT-2) gets ``None`` and
  is fed back the tuples it returns; so does a model whose modeling module defines
  its own cache class (:func:`builds_own_cache`: Jamba, MiniMax, 5.6's OLMo-Hybrid),
  which builds it at the prefill as ``generate`` lets it.
- ``extend(tokens)`` / ``decode(token)``: the next chunk on top of that cache,
  driven as the model's own ``generate`` drives it: an all-ones attention mask
  over every position so far where its ``prepare_inputs_for_generation`` keeps
  one (state-space models drop it after the prefill), ``position_ids`` after
  the cache where they equal the model's own numbering (5.x ``generate``
  passes them; RoBERTa-style models keep theirs), and ``cache_position`` where
  the model's ``forward`` takes it (transformers 4.x).
- The cache argument is named as the model's ``forward`` names it
  (:data:`CACHE_ARGS`): ``cache`` (transformers 5.x), ``past_key_values`` (4.x;
  tuples or ``DynamicCache``) or ``cache_params`` (the state-space models of
  4.x and early 5.x: Mamba, Mamba-2, FalconMamba, which build their own state
  cache at the prefill, as their ``generate`` lets them), so no deprecation
  warning is triggered and old releases work as they are.
- ``recompute_variants(tokens)``: recomputes that differ from ``recompute`` only
  in how they add up, built on deep copies of the model (a shared config would
  switch the model under test too): ``"attention"`` (the other attention
  implementation, eager <-> sdpa), ``"batch"`` (a batch of two copies of the
  sequence) and ``"rows"`` (every linear layer applied one row at a time, the
  decode's matrix-vector order). None goes through a cache. (A left-padded
  recompute was measured and not kept: the `hf_matrix` study with ``variants = "padded"``.)
- ``internal_formats``: the formats of the model's order-sensitive ops (matrix
  products with an inner dimension > 1, softmax, sdpa), measured once on a few
  tokens under a ``TorchDispatchMode`` (:func:`measure_internal_formats`): a
  float32 softmax inside a float64 eager model sets control mode's floor and
  admission ceiling (:mod:`kvfast.check.formats`). Where that format is below the
  model's own, ``recompute_variants`` adds ``"rounding probe"``
  (:func:`probe_recompute`: every value of that format moved by one unit of it),
  which measures what that format does to the logits (:attr:`HFModel.rounding_probe`).
- ``promote(dtype)``: the same adapter over a deep copy of the model in
  ``dtype`` (``check_cache(..., promote="float64")``).

The model is put in eval mode (dropout would make every comparison noise).
A mis-wrapped model (not a torch module, no language-model head, no KV cache,
a sequence longer than its position table) raises ``ValueError``. An exception
the model's own ``forward`` raises is the model's: ``check_cache`` raises
:class:`~kvfast.check.protocol.ModelUnderTestError` naming the call (``kvfast
check``: exit 4), never "not allowed". A variant the model cannot build or run
is skipped (:attr:`HFModel.skipped_variants`, named in the report).

The cached path (prefill, extend, decode) and the cache operations (crop, snapshot, restore, beams, a padded
batch) are :class:`~kvfast.check.hf_path.CachedPath`'s, the one source a standalone reproducer carries too;
this adapter answers how ``generate`` calls the model by measuring it, validates, and adds the recompute, its
variants and the lossy caches. kvfast's own tests and scoring inject cache bugs by subclassing the adapter
(:mod:`kvfast.bugs.hf_mixins`): ``CachedPath``'s methods marked *hook* are where they act.
"""

from __future__ import annotations

import copy
import inspect

import numpy as np

from kvfast.check.engines import choose_variants, run_variants
from kvfast.check.formats import FORMATS, lowest
from kvfast.check.hf_path import CACHE_ARGS, MODEL, CachedPath, cache_layers, new_dynamic_cache
from kvfast.validation import import_extra, not_allowed, require_choice, require_int

VARIANTS = ("attention", "batch", "rows")


class ModelForwardError(RuntimeError):
    """A ``ValueError`` the wrapped model's own ``forward`` raised: the model's failure (``kvfast check``
    exit 4), kept apart from the adapter's ``ValueError`` for bad input. Every other exception of the
    model's ``forward`` passes as it is."""

    def __init__(self, model: str, error: BaseException):
        super().__init__(f"{model}.forward raised ValueError: {' '.join(str(error).split())}")


def _torch():
    return import_extra("torch", "a Hugging Face model", "hf")


def builds_own_cache(model) -> bool:
    """Whether ``model``'s modeling module defines its own cache class (hybrid recurrent models: Jamba, Bamba,
    MiniMax; OLMo-Hybrid in 5.6, whose layers read ``conv_states_q`` that a ``DynamicCache`` lacks): such a model
    is given no cache object and builds its own at the prefill, as ``generate`` lets it."""
    import sys

    module = sys.modules.get(type(model).__module__)
    return any(
        name.endswith("Cache") and isinstance(value, type) and value.__module__ == module.__name__
        for name, value in vars(module or object).items()
    )


def is_hf_model(model: object) -> bool:
    """Whether ``model`` looks like a transformers model (a module with ``config`` and ``forward``) rather
    than a model under test; imports nothing."""
    return (
        not callable(getattr(model, "recompute", None))
        and callable(getattr(model, "forward", None))
        and hasattr(model, "config")
        and hasattr(model, "parameters")
    )


#: Rotary scalings built to run past ``max_position_embeddings`` (their frequencies change with the length).
SCALES_PAST_LIMIT = ("dynamic",)


def scales_past_limit(config) -> bool:
    """Whether ``config``'s rotary scaling is one built to run past ``max_position_embeddings`` (dynamic NTK:
    :data:`SCALES_PAST_LIMIT`), so that a check may go beyond it: its length-dependent rope is exactly what
    must be seen."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict):
        return False
    return (rope.get("rope_type") or rope.get("type")) in SCALES_PAST_LIMIT


def position_limit(config) -> int | None:
    """The most positions ``config`` declares (``max_position_embeddings``, ``n_positions``, ``max_seq_len``)."""
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


#: The order-sensitive aten ops (their result depends on the order of a sum) and what each computes: a row-local
#: cast or an elementwise op computed the same way in both paths cannot make a cache and a recompute differ, a
#: sum can. ``(what, index of the left operand of a matrix product or None)``: a product with an inner
#: dimension of 1 (the rope's ``inv_freq @ positions``) adds nothing and does not count.
ORDER_OPS: dict[str, tuple[str, int | None]] = {
    **{op: ("matrix products", 0) for op in ("mm", "bmm", "matmul", "dot", "vdot", "mv", "_int_mm")},
    **{op: ("matrix products", 1) for op in ("addmm", "baddbmm", "addbmm", "addmv", "_addmm_activation")},
    **{op: ("softmax", None) for op in ("_softmax", "_log_softmax", "softmax", "log_softmax")},
    **{
        op: ("attention", None)
        for op in (
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_attention_math",
            "_scaled_dot_product_cudnn_attention",
            "scaled_dot_product_attention",
        )
    },  # fmt: skip
}
#: torch dtypes as :data:`kvfast.check.formats.FORMATS` names (the integer and float8 formats of quantized kernels)
TORCH_FORMATS = {
    "float64": "float64", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "int8": "int8",
    "uint8": "int8", "float8_e4m3fn": "float8_e4m3", "float8_e4m3fnuz": "float8_e4m3", "float8_e5m2": "float8_e5m2",
    "float8_e5m2fnuz": "float8_e5m2",
}  # fmt: skip


def _order_op(func, args, out) -> tuple[str, str] | None:
    """``(what, format)`` of one aten call if it is order-sensitive (:data:`ORDER_OPS`), else ``None``."""
    torch = _torch()
    found = ORDER_OPS.get(func.overloadpacket.__name__)
    if found is None:
        return None
    what, left = found
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    result = out[0] if isinstance(out, tuple | list) else out
    if left is not None:  # a matrix product: its operands' format, if it sums over more than one term
        if len(args) <= left + 1 or not isinstance(args[left], torch.Tensor) or args[left].shape[-1] <= 1:
            return None
        tensors = [args[left], args[left + 1]] if isinstance(args[left + 1], torch.Tensor) else [args[left]]
    else:  # softmax, attention: the format it computes (and returns) in
        tensors = [result] if isinstance(result, torch.Tensor) else tensors[:1]
    fmts = [TORCH_FORMATS.get(str(t.dtype).removeprefix("torch.")) for t in tensors]
    fmts = [f for f in fmts if f is not None]
    return (what, lowest(fmts)) if fmts else None


def _forward_watching(model, tokens, on_op, run=None):
    """A forward of ``tokens`` (no cache) under a ``TorchDispatchMode`` that hands every aten call's ``(func,
    args, out)`` to ``on_op``, whose return is the call's result from then on; the forward's output. ``run(ids)``
    (``ids``: ``(1, T)`` int64) runs a model that is called otherwise (TransformerLens's)."""
    torch = _torch()
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return on_op(func, args, func(*args, **(kwargs or {})))

    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))[None, :]
    with torch.no_grad(), Watch():
        return model(input_ids=ids, use_cache=False) if run is None else run(ids)


def measure_internal_formats(model, tokens, run=None) -> dict[str, str]:
    """The formats a transformers ``model`` computes its order-sensitive ops in (``{what: format}``, ``what``:
    ``matrix products``, ``softmax``, ``attention``), from one forward of ``tokens`` (no cache) under a
    ``TorchDispatchMode`` that records every aten call (:data:`ORDER_OPS`; the lowest format per kind).
    Llama float64 sdpa: every op float64; Llama and Bloom float64 eager: a float32 softmax. ``run(ids)`` (``ids``:
    ``(1, T)`` int64) runs a model that is called otherwise (TransformerLens's)."""
    seen: dict[str, str] = {}

    def record(func, args, out):
        found = _order_op(func, args, out)
        if found is not None:
            what, fmt = found
            seen[what] = lowest([fmt, seen.get(what, fmt)])
        return out

    _forward_watching(model, tokens, record, run)
    return seen


def probe_recompute(model, tokens, fmt: str, seed: int = 0):
    """A forward of ``tokens`` (no cache) in which every result of an order-sensitive op computed in ``fmt``
    (:data:`ORDER_OPS`) is moved by about one unit in the last place of ``fmt``, up or down at random (seeded):
    what rounding in ``fmt`` at those ops can do to the logits, measured (the ``"rounding probe"`` variant).
    Real order noise moves a few of those values by one unit (where two paths' inputs straddle a rounding
    boundary); the probe moves every one, so it is an upper estimate of the same effect."""
    torch = _torch()
    step = 2.0 ** -(FORMATS[fmt][0] - 1)
    gen = torch.Generator().manual_seed(seed)

    def perturb(func, args, out):
        found = _order_op(func, args, out)
        if found is None or found[1] != fmt or not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return out
        sign = torch.randint(0, 2, out.shape, generator=gen, dtype=torch.float64) * 2 - 1
        return (out.double() * (1 + sign * step)).to(out.dtype)

    return _forward_watching(model, tokens, perturb).logits


def _rowwise(forward):
    """``forward`` of a linear layer applied one row at a time (the decode's matrix-vector order)."""
    torch = _torch()

    def run(x, *args, **kwargs):
        flat = x.reshape(-1, x.shape[-1])
        out = torch.cat([forward(flat[i : i + 1], *args, **kwargs) for i in range(flat.shape[0])])
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return run


class HFModel(CachedPath):
    """A transformers causal LM behind the check protocol (see the module doc); its cached path and cache
    operations are :class:`~kvfast.check.hf_path.CachedPath`'s, with how ``generate`` calls the model measured.

    - ``model``: a ``PreTrainedModel`` with a language-model head (``AutoModelForCausalLM``).
    - ``variants``: which order-noise recomputes :meth:`recompute_variants` offers
      (a subset of :data:`VARIANTS`; ``()`` for none).
    - ``new_cache``: a zero-argument callable returning a fresh cache object
      (for example ``lambda: StaticCache(config=model.config, max_cache_len=256)``);
      default: a ``DynamicCache`` (or what the model returns).
    """

    def __init__(self, model, *, variants=VARIANTS, new_cache=None) -> None:
        torch = _torch()
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise not_allowed("model", type(model).__name__, MODEL)
        self.variants = choose_variants(variants, VARIANTS)
        if new_cache is not None and not callable(new_cache):
            raise not_allowed("new_cache", new_cache, "None or a callable returning a fresh cache")
        super().__init__(model.eval())
        self.new_cache = new_cache
        self._mask_as_generate: dict[tuple, bool] = {}  # _generate_passes_mask's answers
        params = inspect.signature(model.forward).parameters
        takes = [name for name in CACHE_ARGS if name in params]
        if not takes:
            raise not_allowed(
                "model", type(model).__name__, f"{MODEL}; its forward() takes none of {', '.join(CACHE_ARGS)}"
            )
        self.cache_arg = takes[0]
        self.takes_cache_position = "cache_position" in params
        self.takes_mask = "attention_mask" in params
        self.takes_position_ids = "position_ids" in params
        vocab = getattr(model.config, "vocab_size", None)
        self.vocab_size = require_int(vocab, "model.config.vocab_size", 1)
        self.max_positions = None if scales_past_limit(model.config) else position_limit(model.config)
        self._copies: dict[str, object] = {}
        self._formats: dict[str, str] | None = None  # measured on first use (internal_formats)
        self.skipped_variants: dict[str, str] = {}  # variants this model cannot build or run, with the reason

    def __repr__(self) -> str:
        return f"HFModel({type(self.model).__name__}, {self.dtype}, {self.attention})"

    @property
    def dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    @property
    def attention(self) -> str:
        return str(getattr(self.model.config, "_attn_implementation", None) or "eager")

    #: where :attr:`internal_formats` comes from (the protocol's optional attribute; kvfast measures it here)
    internal_formats_source = "measured"
    #: the tokens the internal formats are measured on (every order-sensitive op runs on a few rows)
    PROBE = 4

    @property
    def internal_formats(self) -> dict[str, str] | None:
        """``{what: format}`` of the model's order-sensitive ops (:func:`measure_internal_formats`), measured on
        first use on :attr:`PROBE` tokens; ``None`` (the checker then assumes them) if that forward raises."""
        if self._formats is None:
            tokens = np.arange(self.PROBE) % self.vocab_size
            try:
                self._formats = measure_internal_formats(self.model, tokens)
            except Exception:  # noqa: BLE001 - the check's own calls name the model's errors; here: unknown
                return None
        return dict(self._formats)

    #: the variant that moves every value computed in the lowest internal format by one unit of it (protocol:
    #: the optional ``rounding_probe`` attribute names it)
    PROBE_VARIANT = "rounding probe"

    @property
    def rounding_probe(self) -> str | None:
        """:attr:`PROBE_VARIANT` when an order-sensitive op computes in a format below the model's own (a float32
        softmax in a float64 eager model), else ``None``: what that format's rounding does to the logits is then
        measured (:func:`probe_recompute`) instead of assumed to be one unit of it at the logits' magnitude."""
        low = self._probe_format()
        return None if low is None else self.PROBE_VARIANT

    def _probe_format(self) -> str | None:
        inside = self.internal_formats
        own = TORCH_FORMATS.get(self.dtype)
        if not inside or own is None:
            return None
        low = lowest(inside.values())
        return low if FORMATS[low][0] < FORMATS[own][0] else None

    # --- running the model -----------------------------------------------------------------------

    def _ids(self, tokens, start: int):
        torch = _torch()
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        end = start + tokens.shape[0]
        if self.max_positions is not None and end > self.max_positions:
            raise not_allowed(
                "positions",
                end,
                f"at most {self.max_positions} positions in all (the model's config), prompt and steps included",
            )
        return torch.from_numpy(tokens.copy())[None, :]

    def _call(self, model, **kwargs):
        try:
            logits, cache = super()._call(model, **kwargs)
        except ValueError as exc:  # the model's own error, not kvfast's bad input (which ValueError means here)
            raise ModelForwardError(type(model).__name__, exc) from exc
        if logits is None:
            raise not_allowed("model", type(model).__name__, f"{MODEL}; it returned no logits")
        return logits, cache

    def recompute(self, tokens):
        """Logits ``(T, V)`` of a full forward of ``tokens`` from position 0, no cache."""
        return self._call(self.model, input_ids=self._ids(tokens, 0), use_cache=False)[0][0]

    def _fresh_cache(self):
        if self.new_cache is not None:
            return self.new_cache()
        if self.cache_arg == "cache_params" or builds_own_cache(self.model):  # it builds its own, as generate lets it
            return None
        if getattr(self.model, "_supports_cache_class", True) is False:  # 4.3x GPT-2 and others: tuples only
            return None
        return new_dynamic_cache(self.model.config)

    _generate_prefill_positions: int | None = None  # asked once of a cache_params model (cache_positions); 0: unknown

    def _prefill_positions(self) -> int:
        """How many ``cache_position`` entries the model's ``generate`` gives its prefill (``cache_params`` models,
        :meth:`~kvfast.check.hf_path.CachedPath.cache_positions`; the prompt's length where it cannot be asked):
        asked of the model's ``prepare_inputs_for_generation``."""
        if self._generate_prefill_positions is None:
            torch = _torch()
            self._generate_prefill_positions = 0
            prepare = getattr(self.model, "prepare_inputs_for_generation", None)
            try:
                ids = torch.zeros(1, 1, dtype=torch.long)
                inputs = prepare(ids, cache_params=None, use_cache=True, cache_position=torch.arange(1))
                self._generate_prefill_positions = int(inputs["cache_position"].shape[0])
            except Exception:  # noqa: BLE001 - a release whose generate cannot be asked: the tokens' positions
                pass
        return self._generate_prefill_positions or self.prefill_len

    _positions_as_generate: bool | None = None  # measured on first use (_generate_positions)

    def _generate_positions(self) -> bool:
        """Whether cached calls get ``position_ids`` as ``generate`` gives them (the positions after the cache:
        transformers 5.x's ``generate`` passes them to every decoder-only model whose ``forward`` takes them).

        Only where they are the model's own positions: a recompute of :attr:`PROBE` tokens with ``position_ids``
        ``0..T-1`` must equal, bit for bit, the recompute without them (RoBERTa-style models number positions
        from their padding id: they keep deriving their own). Measured: Bamba's ``forward`` without
        ``position_ids`` numbers a decoded token from 0 whatever the cache holds, which ``generate`` never
        asks of it: clean Bamba was called ``bug`` in float32 (deviations around 1e-3 from decode step 1).
        """
        if self._positions_as_generate is None:
            self._positions_as_generate = False
            if self.takes_position_ids and not getattr(self.model.config, "is_encoder_decoder", False):
                torch = _torch()
                ids = self._ids(np.arange(self.PROBE) % self.vocab_size, 0)
                try:
                    plain, _ = self._call(self.model, input_ids=ids, use_cache=False)
                    numbered, _ = self._call(
                        self.model, input_ids=ids, use_cache=False, position_ids=torch.arange(self.PROBE)[None, :]
                    )
                except Exception:  # noqa: BLE001 - positions it cannot take: it keeps deriving its own
                    return False
                self._positions_as_generate = bool(torch.equal(plain, numbered))
        return self._positions_as_generate

    def _generate_passes_mask(self, ids, mask) -> bool:
        """Whether the model's own ``generate`` passes the attention mask in this call (asked of its
        ``prepare_inputs_for_generation``, with the cache as it is and ``is_first_iteration`` for the prefill).

        State-space models (Mamba, FalconMamba, Mamba-2, the hybrids built on their mixers) drop it after the
        first call: their mixers multiply the new tokens' hidden states by the mask (padding states zeroed),
        and a mask over every position so far broadcasts one decoded token into as many rows as positions
        (measured: clean Mamba called ``bug`` at decode step 2 with deviations above 1, and its resume raising
        in ``extend``). Where the question cannot be asked (a release or model whose
        ``prepare_inputs_for_generation`` takes other arguments), the mask is passed, as ``generate`` does for
        attention models.
        """
        # asked once per (prefill or not, chunk length, cache type), not on every decode step: the answer is the model's
        # generation logic, which reads whether this is the first call and the inputs' shape, not their values
        key = (self.length == 0, ids.shape[1], type(self.cache))
        if key not in self._mask_as_generate:
            self._mask_as_generate[key] = self._ask_generate_for_mask(ids, mask)
        return self._mask_as_generate[key]

    def _ask_generate_for_mask(self, ids, mask) -> bool:
        prepare = getattr(self.model, "prepare_inputs_for_generation", None)
        if prepare is None:
            return True
        torch = _torch()
        n = ids.shape[1]
        so_far = torch.cat([torch.zeros(1, self.length, dtype=ids.dtype), ids], dim=1)  # only the shape is read
        # the state-space models of 4.x read the positions from cache_position (their generate passes it)
        where = {"cache_position": self.cache_positions(n)} if self.cache_arg == "cache_params" else {}
        try:
            inputs = prepare(
                so_far,
                next_sequence_length=n,
                **{self.cache_arg: self.cache},
                attention_mask=mask,
                use_cache=True,
                is_first_iteration=self.length == 0,
                **where,
            )
        except Exception:  # noqa: BLE001 - a signature of another release: generate's default (the mask) stands
            return True
        return not isinstance(inputs, dict) or inputs.get("attention_mask", mask) is not None

    def decode(self, token):
        """One token at the cache's next position; logits ``(V,)``."""
        self._require_cache()
        return super().decode(require_int(token, "token", 0, self.vocab_size - 1))

    # --- order noise and promotion -------------------------------------------------------------

    def _copy(self, name: str):
        if name not in self._copies:
            clone = copy.deepcopy(self.model)
            if name == "attention":
                other = "eager" if self.attention != "eager" else "sdpa"
                clone.set_attn_implementation(other)  # eager-only models raise (Gemma2, gpt-oss)
                got = str(getattr(clone.config, "_attn_implementation", None) or "eager")
                if got != other:  # Bloom only warns and stays eager: the variant would measure nothing
                    raise ValueError(f"asked for {other!r} attention, the model stayed {got!r}")
            elif name == "rows":
                torch = _torch()
                for module in clone.modules():
                    if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D":
                        module.forward = _rowwise(module.forward)
            self._copies[name] = clone.eval()
        return self._copies[name]

    def recompute_variants(self, tokens) -> dict:
        """Recomputes of ``tokens`` that differ from :meth:`recompute` only in how they add up (no cache).
        A variant the model cannot build or run is left out and named in :attr:`skipped_variants` with the
        reason (an eager-only model has no other attention; a router that returns a tuple has no rows)."""
        probe = (self.PROBE_VARIANT,) if self._probe_format() is not None and self.variants else ()
        out = run_variants(self, self.variants + probe, lambda name: self._variant(name, tokens))
        for name in self.skipped_variants:  # a copy that could not run is not kept
            self._copies.pop(name, None)
        return out

    def _variant(self, name: str, tokens):
        ids = self._ids(tokens, 0)
        if name == self.PROBE_VARIANT:
            return probe_recompute(self.model, ids[0].numpy(), self._probe_format())[0]
        model, ids = (self.model, ids.repeat(2, 1)) if name == "batch" else (self._copy(name), ids)
        return self._call(model, input_ids=ids, use_cache=False)[0][0]

    def promote(self, dtype: str = "float64") -> HFModel:
        """The same adapter (bug and variants included) over a deep copy of the model in ``dtype``."""
        torch = _torch()
        require_choice(dtype, "promote", ("float64", "float32"))
        new = copy.copy(self)
        new.model = copy.deepcopy(self.model).to(getattr(torch, dtype)).eval()
        new._copies, new._mask_as_generate, new.skipped_variants, new._formats = {}, {}, {}, None  # the copy's own
        new.cache, new.length = None, 0
        return new

    # --- cache operations (kvfast.check.hf_path), their arguments validated ------------------------------------

    def crop(self, n: int) -> None:
        """Keep the first ``n`` positions of the cache (:meth:`~kvfast.check.hf_path.CachedPath.crop`)."""
        self._require_cache()
        super().crop(require_int(n, "n", 0, self.length))

    def restore(self, state) -> None:
        """The cache set back to a copy of ``state`` (:meth:`~kvfast.check.hf_path.CachedPath.restore`), kvfast's
        lossy emulation wrapped again around the copy with its frozen scales."""
        super().restore(state)
        if self.lossy_emulation is not None:
            frozen = dict(getattr(self.cache, "lossy_scales", {}))
            wrap_round_trip(self.cache, self.lossy_emulation)
            self.cache.lossy_scales.update(frozen)

    # --- lossy caches (kvfast.check.lossy) ---------------------------------------------------------------------

    lossy_emulation: str | None = None  # set on with_lossy_cache's twin: kvfast's own round trip of the format

    @property
    def lossy_cache(self) -> str | None:
        """The format of a lossy cache: kvfast's emulation's, else read from a fresh cache's layers (a
        ``QuantizedCache``: ``fp8-tensor`` for its fp8 backend, ``int<nbits>`` for quanto and HQQ), else ``None``."""
        if self.lossy_emulation is not None or self.new_cache is None:
            return self.lossy_emulation
        found = None
        for layer in cache_layers(self.new_cache()):
            name = type(layer).__name__
            if name == "Fp8QuantizedLayer":
                found = "fp8-tensor"
            elif "Quantized" in name:
                found = f"int{int(getattr(layer, 'nbits', 4))}"
        return found

    def lossless(self) -> HFModel:
        """The same adapter (bugs included) over a fresh ``DynamicCache``: the cache unquantized."""
        twin = copy.copy(self)
        twin.new_cache, twin.lossy_emulation = None, None
        twin.cache, twin.length = None, 0
        return twin

    def with_lossy_cache(self, fmt: str) -> HFModel:
        """The unquantized adapter with kvfast's own round trip of ``fmt`` on a ``DynamicCache`` (the format's
        expected error)."""
        twin, config = self.lossless(), self.model.config
        twin.new_cache, twin.lossy_emulation = (lambda: wrap_round_trip(new_dynamic_cache(config), fmt)), fmt
        return twin


def _round_trip_tensor(fmt: str, tensor, scale: float | None = None):
    torch = _torch()
    from kvfast.check.lossy_formats import round_trip

    out = round_trip(fmt, tensor.detach().double().numpy(), scale)
    return torch.from_numpy(out).to(tensor.dtype)


def wrap_round_trip(cache, fmt: str):
    """Round-trip every key and value ``cache`` stores through ``fmt`` (kvfast's own emulation); a prefill
    attends its fresh rows, every later call the stored ones (as transformers' quantized layers do).
    ``fp8-tensor``: each layer's key and value scales are frozen at its first store. Returns ``cache``."""
    from kvfast.check.lossy_formats import FP8_MAX

    update = cache.update
    scales: dict[int, tuple] = {}

    def lossy_update(key_states, value_states, layer_idx, *args, **kwargs):
        n = key_states.shape[-2]
        if fmt == "fp8-tensor" and layer_idx not in scales:
            scales[layer_idx] = tuple(float(t.abs().amax().float()) / FP8_MAX for t in (key_states, value_states))
        ks, vs = scales.get(layer_idx, (None, None))
        kq, vq = _round_trip_tensor(fmt, key_states, ks), _round_trip_tensor(fmt, value_states, vs)
        keys, values = update(kq, vq, layer_idx, *args, **kwargs)
        if n > 1 and keys.shape[-2] == n:
            return key_states, value_states
        return keys, values

    cache.update = lossy_update
    cache.lossy_scales = scales  # a restored copy keeps the frozen scales (restore wraps the copy again)
    return cache
