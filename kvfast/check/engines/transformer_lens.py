"""TransformerLens models as models under test: ``TLModel(model)`` over a ``HookedTransformer`` and its own KV cache
(extra ``kvfast[transformer_lens]``; docs/engines.md, "TransformerLens").

A ``HookedTransformer`` (TransformerLens 2.x and 3.x) behind the check protocol (:mod:`kvfast.check.protocol`)::

    report = kvfast.check_cache(model, [1, 2, 3], 64)  # a HookedTransformer as it is: wrapped in TLModel

What the adapter does (every call under ``torch.no_grad()``, the model in eval mode):

- ``prefill(tokens)``: a fresh TransformerLens cache (``TransformerLensKeyValueCache`` in 3.x,
  ``HookedTransformerKeyValueCache`` in 2.x: ``init_cache(cfg, device, 1)``), then ``model(tokens,
  past_kv_cache=cache)``; ``extend(tokens)`` and ``decode(token)``: ``model(tokens, past_kv_cache=cache)`` over
  it. That is what ``model.generate`` runs.
- ``recompute(tokens)``: ``model(tokens)``, no cache.
- **The attention mask**: a cached forward builds its mask from ``model.tokenizer`` (``pad_token_id``), and without a
  tokenizer fails (3.x: ``Cannot compute attention mask without a tokenizer``; 2.7: ``'NoneType' object has no
  attribute 'pad_token_id'``). Passing ``attention_mask`` instead is release-dependent: 3.x appends it to the
  cache's mask, 2.7 takes it as the whole mask and a multi-token chunk over a cache fails (``The size of tensor a
  (2) must match the size of tensor b (0)``). So during each of kvfast's calls ``model.tokenizer`` is
  :data:`NO_PADS`, a stand-in whose pad id is no token: every position is attended, on every release, and the
  model's own tokenizer (or ``None``) is put back after the call.
- **ALiBi**: each attention layer keeps its bias matrix (``attn.alibi``) and rebuilds it only for a longer
  sequence than it holds; a call over a shorter one reads the bottom rows of the larger matrix, a constant shift
  of each query's scores that changes their rounding. A recompute of the whole sequence would so change what a
  later cached call computes; kvfast sets ``attn.alibi = None`` before each call, so every call computes as a
  freshly built model's first call (the bias of the true positions).
- ``recompute_variants`` (control mode's order noise): ``"rows"``, the recompute with every matrix product
  (``mm``, ``addmm``, ``bmm``: TransformerLens's ``F.linear``, ``addmm`` and 4-D ``@``) computed one row at a time
  (:func:`_one_row_products`), the order of a decode step's products, which take one position. TransformerLens
  calls no ``nn.Linear``, so a variant that runs linear layers row by row (the Hugging Face adapter's) changes
  nothing.
- ``internal_formats``: the formats of the model's order-sensitive ops, measured on a few tokens as for a Hugging
  Face model (:func:`kvfast.check.hf.measure_internal_formats`): a bridge over an eager Llama computes its softmax
  in float32 even in float64.
- ``promote("float64")``: the same adapter (its bug included) over a deep copy of the model in float64.

``TLBridgeModel(bridge)``: a ``TransformerBridge`` (TransformerLens 3.x and 4.x, over a transformers model) through its
own manual KV-cache entry point: ``prefill`` is ``bridge(tokens, return_type="logits_and_cache")``, ``extend`` and
``decode`` hand the returned transformers cache back (``past_key_values=cache``), the recompute is ``bridge(tokens)``;
the same ``"rows"`` variant, internal formats and promotion.

Bugs for kvfast's tests are injected by subclassing these adapters (:data:`kvfast.bugs.engine_bugs.TL_BUGS`, over
``decode``, ``extend`` and the cache itself: :attr:`TLModel.cache`).
"""

from __future__ import annotations

import copy
import functools
import importlib.metadata
import json
import os
import warnings
from pathlib import Path

import numpy as np

from kvfast.check.engines import FedCache, choose_variants
from kvfast.validation import import_extra, not_allowed, require_choice, require_int

#: The order-noise variants built by default.
VARIANTS = ("rows",)
MODEL = "a transformer_lens.HookedTransformer or a JSON file of HookedTransformerConfig fields"
BRIDGE = "a transformer_lens TransformerBridge or a transformers model directory (with its tokenizer)"
#: torch dtypes by name (a config file's ``dtype``, :func:`kvfast.testing.tiny_tl_model`'s).
DTYPES = ("float32", "float64", "bfloat16", "float16")


def _is_tl(model: object, name: str) -> bool:
    """Whether ``model`` is an instance of TransformerLens's class ``name`` (a subclass included; imports nothing)."""
    return any(cls.__name__ == name and cls.__module__.startswith("transformer_lens") for cls in type(model).__mro__)


def is_hooked_transformer(model: object) -> bool:
    """Whether ``model`` is a ``transformer_lens.HookedTransformer`` (a subclass included; imports nothing)."""
    return _is_tl(model, "HookedTransformer")


def is_transformer_bridge(model: object) -> bool:
    """Whether ``model`` is a TransformerLens ``TransformerBridge`` (a subclass included; imports nothing)."""
    return _is_tl(model, "TransformerBridge")


def engine_model(path, **kwargs):
    """``kvfast check --engine transformer_lens PATH``: a directory is a transformers model booted into a
    ``TransformerBridge`` (:class:`TLBridgeModel`), a file a ``HookedTransformerConfig`` (:class:`TLModel`); ``kwargs``
    go to that adapter."""
    if isinstance(path, str | os.PathLike) and Path(path).is_dir():
        return TLBridgeModel(path, **kwargs)
    return TLModel(path, **kwargs)


class _NoPads:
    """A stand-in tokenizer for the length of kvfast's calls: TransformerLens builds a cached forward's attention
    mask from it, and no token is its pad (every position attended)."""

    pad_token_id = -1
    bos_token_id = None
    padding_side = "right"

    def __repr__(self) -> str:
        return "NO_PADS"


NO_PADS = _NoPads()


def _tl():
    return import_extra("transformer_lens", "a TransformerLens model", "transformer_lens")


def _torch():
    return import_extra("torch", "a TransformerLens model", "transformer_lens")


def _hooked(name: str):
    """TransformerLens's ``HookedTransformer`` or ``HookedTransformerConfig``; ``ValueError`` on a release without
    them (4.0 removed them: its import raises ``ImportError``)."""
    tl = _tl()
    try:
        return getattr(tl, name)
    except (AttributeError, ImportError):
        try:
            release = importlib.metadata.version("transformer-lens")
        except importlib.metadata.PackageNotFoundError:
            release = "this release"
        allowed = "a release with HookedTransformer (2.x, 3.x; 4.0 removed it): pip install 'transformer-lens<4'"
        raise not_allowed("transformer_lens", release, f"{allowed}, or check a TransformerBridge") from None


def cache_class():
    """TransformerLens's KV cache class: ``TransformerLensKeyValueCache`` (3.x), else
    ``HookedTransformerKeyValueCache`` (2.x)."""
    tl = _tl()
    return getattr(tl, "TransformerLensKeyValueCache", None) or tl.HookedTransformerKeyValueCache


def model_from_config(path, seed: int = 0, weights=None):
    """A ``HookedTransformer`` built from a JSON file of ``HookedTransformerConfig`` fields (``dtype`` by name:
    :data:`DTYPES`), random weights from ``seed`` or, with ``weights``, a state dict saved by
    ``torch.save(model.state_dict(), weights)``."""
    try:
        fields = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise not_allowed("path", str(path), f"{MODEL} ({type(exc).__name__}: {exc})") from None
    if not isinstance(fields, dict):
        raise not_allowed("path", str(path), f"{MODEL} (a JSON object)")
    model = model_from_fields(fields, seed, f"{path}: dtype")
    if weights is not None:
        if not isinstance(weights, str | os.PathLike) or not Path(weights).is_file():
            raise not_allowed("weights", weights, "a state dict file saved by torch.save(model.state_dict(), path)")
        model.load_state_dict(_torch().load(weights, map_location=model.cfg.device, weights_only=True))
    return model


def model_from_fields(fields: dict, seed: int = 0, dtype_field: str = "dtype"):
    """A ``HookedTransformer`` of ``HookedTransformerConfig`` fields (``dtype`` by name: :data:`DTYPES`, an
    error naming ``dtype_field``), random weights from ``seed``."""
    fields = dict(fields)
    if "dtype" in fields:
        fields["dtype"] = getattr(_torch(), require_choice(fields["dtype"], dtype_field, DTYPES))
    cfg = _hooked("HookedTransformerConfig")(**{**fields, "seed": require_int(seed, "seed")})
    with warnings.catch_warnings():  # without 3.x's warning that the class goes in 4.0: kvfast, not the user, built it
        warnings.filterwarnings("ignore", "HookedTransformer is deprecated", DeprecationWarning)
        return _hooked("HookedTransformer")(cfg)


def _one_row_products():
    """A ``TorchDispatchMode`` under which every matrix product (``mm``, ``addmm``, ``bmm``) is computed one row
    of its left operand at a time: the order of a decode step, whose products take one position."""
    torch = _torch()
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    left = {aten.mm.default: 0, aten.addmm.default: 1, aten.bmm.default: 0}

    class OneRowProducts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            i = left.get(func)
            if i is None or args[i].shape[-2] <= 1:
                return func(*args, **kwargs)
            a, rows = args[i], args[i].shape[-2]
            parts = [func(*args[:i], a[..., r : r + 1, :], *args[i + 1 :], **kwargs) for r in range(rows)]
            return torch.cat(parts, dim=-2)

    return OneRowProducts()


class _TLAdapter(FedCache):
    """What both TransformerLens adapters share: the protocol's calls over the class's own cache
    (:class:`~kvfast.check.engines.FedCache`; ``_feed``: one cached forward of tokens on :attr:`cache`, ``_new_cache``:
    a fresh one), the ``"rows"`` variant, the internal formats and the promotion."""

    def __init__(self, model, variants, vocab_size: int, max_positions: int) -> None:
        self.model = model.eval()
        self.variants = choose_variants(variants, VARIANTS)
        self.vocab_size = int(vocab_size)
        self.max_positions = int(max_positions)
        self.cache = None

    def recompute(self, tokens):
        """Logits ``(T, V)`` of ``tokens`` with no cache."""
        return self._forward(tokens)

    def _ids(self, tokens):
        return _torch().as_tensor(np.asarray(tokens, dtype=np.int64).reshape(1, -1), device=self.model.cfg.device)

    def _fresh(self) -> None:
        self.cache = self._new_cache()

    #: where :attr:`internal_formats` comes from (the protocol's optional attribute)
    internal_formats_source = "measured"

    @functools.cached_property
    def internal_formats(self) -> dict[str, str]:
        """``{what: format}`` of the order-sensitive ops of a recompute of 4 tokens (measured once)."""
        from kvfast.check.hf import measure_internal_formats

        return measure_internal_formats(self.model, np.arange(4) % self.vocab_size, run=self._forward)

    def recompute_variants(self, tokens) -> dict:
        """The recompute of ``tokens`` in another order of additions (:data:`VARIANTS`; the module doc)."""
        out = {}
        if "rows" in self.variants:
            with _one_row_products():
                out["rows"] = self._forward(tokens)
        return out

    def promote(self, dtype: str = "float64"):
        """The same adapter (an injected bug included: the same class) over a deep copy of the model in ``dtype``
        (the model under test is not changed)."""
        require_choice(dtype, "dtype", ("float64",))
        promoted = copy.deepcopy(self.model)
        promoted.to(getattr(_torch(), dtype), print_details=False)
        return type(self)(promoted, variants=self.variants)


class TLModel(_TLAdapter):
    """A TransformerLens ``HookedTransformer`` behind the check protocol, through its own KV cache (see the module
    doc): ``prefill``, ``extend`` and ``decode`` are ``model(tokens, past_kv_cache=cache)`` over a fresh
    TransformerLens cache, ``recompute`` is ``model(tokens)``.

    - ``path``: a ``HookedTransformer`` (checked as it is: its tokenizer and ALiBi buffers are set aside only
      during kvfast's calls), or a JSON file of ``HookedTransformerConfig`` fields (:func:`model_from_config`,
      with ``seed`` and ``weights``): what ``kvfast check --engine transformer_lens CONFIG.json`` builds.
    - ``variants``: the order-noise variants to build, of :data:`VARIANTS`.
    """

    def __init__(self, path, *, variants=VARIANTS, seed: int = 0, weights=None):
        model = path
        if isinstance(path, str | os.PathLike):
            if not Path(path).is_file():
                raise not_allowed("path", str(path), MODEL)
            model = model_from_config(path, seed, weights)
        if not is_hooked_transformer(model):
            raise not_allowed("path", type(model).__name__, MODEL)
        super().__init__(model, variants, model.cfg.d_vocab_out, model.cfg.n_ctx)

    def __repr__(self) -> str:
        cfg = self.model.cfg
        return f"TLModel({cfg.positional_embedding_type}, {str(cfg.dtype).removeprefix('torch.')})"

    def _forward(self, tokens, cache=None):
        """``model(tokens, past_kv_cache=cache)``'s logits ``(n, V)``: under ``no_grad``, with :data:`NO_PADS` as
        the tokenizer and every ALiBi buffer reset (the module doc), the model's tokenizer put back after."""
        model, ids = self.model, self._ids(tokens)
        saved = model.tokenizer
        model.tokenizer = NO_PADS
        self._reset_alibi()
        try:
            with _torch().no_grad():
                logits = model(ids) if cache is None else model(ids, past_kv_cache=cache)
        finally:
            model.tokenizer = saved
        return logits[0]

    def _feed(self, tokens):
        return self._forward(tokens, self.cache)

    def _reset_alibi(self) -> None:
        """Every attention layer's ALiBi bias matrix dropped: the call rebuilds it for its own length (the module
        doc)."""
        for block in self.model.blocks:
            if getattr(block.attn, "alibi", None) is not None:
                block.attn.alibi = None

    def _new_cache(self):
        return cache_class().init_cache(self.model.cfg, self.model.cfg.device, 1)

    @property
    def length(self) -> int:
        """The positions the cache under test holds."""
        return 0 if self.cache is None else int(self.cache.entries[0].past_keys.shape[1])


class TLBridgeModel(_TLAdapter):
    """A TransformerLens ``TransformerBridge`` behind the check protocol, through the transformers cache it hands
    back (see the module doc): ``prefill`` is ``bridge(tokens, return_type="logits_and_cache")``, ``extend`` and
    ``decode`` pass the cache back (``past_key_values=cache``), ``recompute`` is ``bridge(tokens)``.

    - ``path``: a ``TransformerBridge``, or a transformers model directory with its tokenizer
      (``TransformerBridge.boot_transformers(path)``).
    - ``variants``: the order-noise variants to build, of :data:`VARIANTS`.
    """

    def __init__(self, path, *, variants=VARIANTS):
        bridge = path
        if isinstance(path, str | os.PathLike):
            if not Path(path).is_dir():
                raise not_allowed("path", str(path), BRIDGE)
            from transformer_lens.model_bridge import TransformerBridge

            bridge = TransformerBridge.boot_transformers(str(path))
        if not is_transformer_bridge(bridge):
            raise not_allowed("path", type(bridge).__name__, BRIDGE)
        super().__init__(bridge, variants, bridge.cfg.d_vocab, bridge.cfg.n_ctx)

    def __repr__(self) -> str:
        dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        return f"TLBridgeModel({type(self.model.original_model).__name__}, {dtype})"

    def _forward(self, tokens):
        """``bridge(tokens)``'s logits ``(n, V)``."""
        with _torch().no_grad():
            return self.model(self._ids(tokens))[0]

    def _feed(self, tokens):
        """``bridge(tokens, return_type="logits_and_cache")`` over :attr:`cache` (``None``: a fresh one); the cache
        it returns kept."""
        past = {} if self.cache is None else {"past_key_values": self.cache}
        with _torch().no_grad():
            logits, self.cache = self.model(self._ids(tokens), return_type="logits_and_cache", **past)
        return logits[0]

    def _new_cache(self):
        return None  # the bridge's transformers model makes a fresh cache

    @property
    def length(self) -> int:
        """The positions the cache under test holds (what the transformers cache says it holds)."""
        return 0 if self.cache is None else int(self.cache.get_seq_length())
