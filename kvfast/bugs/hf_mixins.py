"""The injected bugs of a Hugging Face cached path, written once: each a mixin over the hooks of
:class:`kvfast.check.hf_path.CachedPath`, named by its catalogue and bug (``catalogue``, ``bug``).

kvfast's catalogues inject them into :class:`~kvfast.check.hf.HFModel` (:mod:`kvfast.bugs.hf`,
:mod:`kvfast.bugs.operations`), and a standalone reproducer of an injected bug carries the bug's classes
verbatim over its own ``CachedPath`` (:mod:`kvfast.repro.patches`), so the script shows the very bug kvfast
found. So a class here uses nothing but torch (imported where it is used) and the names of ``CachedPath``'s
module (which every script carries).
"""

from kvfast.check.hf_path import cache_layers


class HFBug:
    """What every bug of the ``hf`` catalogue shares: its name (``bug``), shown in the adapter's repr."""

    catalogue = "hf"
    bug: str

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, bug={self.bug!r})"


class Window(HFBug):
    """An unasked-for sliding window: decode attends only the last :attr:`window` positions."""

    bug = "window"
    window = 8

    def _attention_mask(self, n: int):
        mask = super()._attention_mask(n)
        if n == 1:
            mask[0, : max(0, self.length + n - self.window)] = 0
        return mask

    def _generate_passes_mask(self, ids, mask) -> bool:
        passes = super()._generate_passes_mask(ids, mask)
        if not passes and ids.shape[1] == 1:  # the bug lives in the mask: a model given none cannot take it
            raise ValueError(
                f"bug: {self.bug!r} is not allowed; allowed: a bug the model can take (its generate passes no "
                "attention mask)"
            )
        return passes


class Positions(HFBug):
    """A bug in the decoded token's ``position_ids`` (a subclass's ``_position()``): a model whose forward takes
    none cannot take it."""

    def _decode_positions(self) -> list[int]:
        if not self.takes_position_ids:
            raise ValueError(
                f"bug: {self.bug!r} is not allowed; allowed: a bug the model's forward() can take (it has no "
                "position_ids)"
            )
        return [self._position()]


class PositionOff(Positions):
    """Decode position off by one (``position_ids`` one behind)."""

    bug = "posoff"

    def _position(self) -> int:
        return self.length - 1


class Restart(Positions):
    """A resume restarts positions at the first chunk's length (the extended chunk is not counted)."""

    bug = "restart"

    def _position(self) -> int:
        return self.prefill_len + self.decoded


class CacheUpdate(HFBug):
    """A bug inside the cache: the fresh (or restored) cache's ``update`` wrapped by :meth:`_update`."""

    def _wrap_cache(self) -> None:
        super()._wrap_cache()
        if not callable(getattr(self.cache, "update", None)):
            raise ValueError(
                f"bug: {self.bug!r} is not allowed; allowed: a bug the model's cache can take (its cache is a "
                "tuple, no update())"
            )
        self.cache.update = self._update(self.cache.update)


class Freeze(CacheUpdate):
    """The last layer's key frozen after decode step 1: later decode steps store step 1's key."""

    bug = "freeze"

    def _update(self, update):
        last_layer = int(self.model.config.num_hidden_layers) - 1
        frozen: dict[str, object] = {}

        def frozen_update(key_states, value_states, layer_idx, *args, **kwargs):
            if layer_idx == last_layer and key_states.shape[-2] == 1:
                step = self.decoded  # decode step being computed (1-based; incremented before the call)
                if step == 1:
                    frozen["key"] = key_states.clone()
                elif step > 1 and "key" in frozen:
                    key_states = frozen["key"]
            return update(key_states, value_states, layer_idx, *args, **kwargs)

        return frozen_update


class Float16(CacheUpdate):
    """Every key and value the cache stores round-tripped through float16 (the prefill attends its fresh ones)."""

    bug = "f16"

    def _update(self, update):
        import torch

        def f16_update(key_states, value_states, layer_idx, *args, **kwargs):
            n = key_states.shape[-2]
            k16 = key_states.to(torch.float16).to(key_states.dtype)
            v16 = value_states.to(torch.float16).to(value_states.dtype)
            keys, values = update(k16, v16, layer_idx, *args, **kwargs)
            if n > 1 and keys.shape[-2] == n:  # the prefill attends its fresh keys; the cache keeps rounded ones
                return key_states, value_states
            return keys, values

        return f16_update


class Replay(HFBug):
    """A token appended twice: ``extend()`` first re-appends the last token already in the cache."""

    bug = "replay"

    def extend(self, tokens):
        self._require_cache()
        return self._cached([self.last_token, *(int(t) for t in tokens)])[1:]


# --- the operation bugs (the ``operations`` catalogue) ------------------------------------------------------


class CropShort:
    """A rollback that crops one token too few: ``crop(n)`` keeps ``n + 1`` positions."""

    catalogue, bug = "operations", "crop_short"

    def _crop_keep(self, n: int, length: int) -> int:
        return n + 1 if n < length else n


class ForkSharedKeys:
    """A fork that shares the key tensor: the copy's layers keep the original key tensors (a cache that writes its
    keys in place, such as a ``StaticCache``, then shows the second branch's keys in the first)."""

    catalogue, bug = "operations", "fork_shared_keys"

    def _copy_cache(self, cache):
        clone = super()._copy_cache(cache)
        for mine, theirs in zip(cache_layers(clone), cache_layers(cache), strict=True):
            mine.keys = theirs.keys
        return clone


class ReorderWrongIndex:
    """A beam reorder by the wrong index: the cache keeps its old order."""

    catalogue, bug = "operations", "reorder_wrong_index"

    def _reorder_cache(self, cache, index) -> None:
        return None


class ReorderKeysOnly:
    """A beam reorder of the keys only: the values stay in the old order."""

    catalogue, bug = "operations", "reorder_keys_only"

    def _reorder_cache(self, cache, index) -> None:
        for layer in cache_layers(cache):
            layer.keys = layer.keys.index_select(0, index)


class PaddedPositionsFromStart:
    """A left-padded batch whose positions count from the padded start (every row numbered as if it had no
    pads)."""

    catalogue, bug = "operations", "padded_positions_from_start"

    def _padded_positions(self, mask, n: int):
        import torch

        width = mask.shape[1]
        return torch.arange(width - n, width).repeat(mask.shape[0], 1)


class WindowEvictsOneTooMany:
    """Every call of the cache path (prefill, chunks, decode, beams, padded batches; never the recompute) runs
    with the model config's ``sliding_window`` one smaller: the masks the model builds then let each query
    attend the last ``window - 1`` positions, as a cache that evicts one position too many leaves it, while the
    cache layers, built with the true window, keep what they always keep."""

    catalogue, bug = "operations", "window_evicts_one_too_many"

    def _cached_forward(self, **kwargs):
        config = self.model.config
        window = config.sliding_window
        config.sliding_window = window - 1
        try:
            return super()._cached_forward(**kwargs)
        finally:
            config.sliding_window = window
