"""The injected catalogue bugs a standalone script can carry: each as a few lines of Python that subclass the
script's ``CachedPath`` and misbehave exactly as kvfast's mixin does (:mod:`kvfast.bugs.hf`,
:mod:`kvfast.bugs.operations`), so that the script, which never imports kvfast, shows the same bug.

:data:`PATCHES`: ``{(catalogue, name): script text}``. The bugs of the scenarios the script does not replay
Every bug of both catalogues but ``static_never_cleared`` (a bug across several prefills of one
``StaticCache``, injected by replacing ``new_cache``, so neither seen in an adapter nor carried): :func:`patch_for`
says so.
"""

from __future__ import annotations

from kvfast.validation import not_allowed

_POSOFF = '''
class CachedPath(CachedPath):
    """INJECTED BUG (kvfast's catalogue 'hf', 'posoff'): the decoded token's position_ids one behind."""

    def decode_positions(self):
        return [self.length - 1]
'''
_RESTART = '''
class CachedPath(CachedPath):
    """INJECTED BUG (kvfast's catalogue 'hf', 'restart'): a resume restarts positions at the first chunk's
    length (decode position = prefill length + tokens decoded; the extended chunk is not counted)."""

    def decode_positions(self):
        return [self.prefill_len + self.decoded]
'''
_REPLAY = '''
class CachedPath(CachedPath):
    """INJECTED BUG (kvfast's catalogue 'hf', 'replay'): extend() first re-appends the last token already in
    the cache."""

    def extend(self, tokens):
        return self.forward([self.last_token, *tokens])[1:]
'''
_WINDOW = '''
HF_WINDOW = {window}


class CachedPath(CachedPath):
    """INJECTED BUG (kvfast's catalogue 'hf', 'window'): an unasked-for sliding window: decode attends only the
    last HF_WINDOW positions."""

    def attention_mask(self, n):
        mask = super().attention_mask(n)
        if n == 1:
            mask[0, : max(0, self.length + n - HF_WINDOW)] = 0
        return mask
'''
_FREEZE = '''
class CachedPath(CachedPath):
    """INJECTED BUG (kvfast's catalogue 'hf', 'freeze'): the last layer's key frozen after decode step 1: later
    decode steps store step 1's key."""

    def wrap_cache(self):
        update, last_layer, frozen, path = self.cache.update, self.model.config.num_hidden_layers - 1, {}, self

        def frozen_update(key_states, value_states, layer_idx, *args, **kwargs):
            if layer_idx == last_layer and key_states.shape[-2] == 1:
                if path.decoded == 1:
                    frozen["key"] = key_states.clone()
                elif path.decoded > 1 and "key" in frozen:
                    key_states = frozen["key"]
            return update(key_states, value_states, layer_idx, *args, **kwargs)

        self.cache.update = frozen_update
'''
_F16 = '''
class CachedPath(CachedPath):
    """INJECTED BUG (kvfast's catalogue 'hf', 'f16'): every key and value the cache stores round-tripped
    through float16 (the prefill attends its own fresh keys)."""

    def wrap_cache(self):
        update = self.cache.update

        def f16_update(key_states, value_states, layer_idx, *args, **kwargs):
            n = key_states.shape[-2]
            k16 = key_states.to(torch.float16).to(key_states.dtype)
            v16 = value_states.to(torch.float16).to(value_states.dtype)
            keys, values = update(k16, v16, layer_idx, *args, **kwargs)
            if n > 1 and keys.shape[-2] == n:
                return key_states, value_states
            return keys, values

        self.cache.update = f16_update
'''
_CROP_SHORT = '''
class CachedPath(CachedPath):
    """INJECTED BUG (kvfast's catalogue 'operations', 'crop_short'): a rollback that crops one token too few:
    crop(n) keeps n + 1 positions."""

    def crop_keep(self, n, length):
        return n + 1 if n < length else n
'''
_WINDOW_EVICTS = '''
class CachedPath(CachedPath):
    """INJECTED BUG (kvfast's catalogue 'operations', 'window_evicts_one_too_many'): every cached call runs with
    the config's sliding_window one smaller (the cache layers keep the true window); the recompute never."""

    def cached_forward(self, **kwargs):
        config = self.model.config
        window = config.sliding_window
        config.sliding_window = window - 1
        try:
            return super().cached_forward(**kwargs)
        finally:
            config.sliding_window = window
'''


_FORK_SHARED_KEYS = '''
class CachedPath(CachedPath):
    """INJECTED BUG (kvfast's catalogue 'operations', 'fork_shared_keys'): a fork that shares the key tensor:
    snapshot() and restore() copy the values, not the keys (a cache that writes its keys in place, such as a
    StaticCache, then shows the second branch's keys in the first)."""

    def copy_cache(self, cache):
        clone = super().copy_cache(cache)
        for mine, theirs in zip(clone.layers, cache.layers):
            mine.keys = theirs.keys
        return clone
'''
_REORDER_WRONG_INDEX = '''
class CachedPath(CachedPath):
    """INJECTED BUG (kvfast's catalogue 'operations', 'reorder_wrong_index'): a beam reorder by the wrong index:
    the cache keeps its old order."""

    def reorder_cache(self, index):
        return None
'''
_REORDER_KEYS_ONLY = '''
class CachedPath(CachedPath):
    """INJECTED BUG (kvfast's catalogue 'operations', 'reorder_keys_only'): a beam reorder of the keys only: the
    values stay in the old order."""

    def reorder_cache(self, index):
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)
'''
_PADDED_FROM_START = '''
class CachedPath(CachedPath):
    """INJECTED BUG (kvfast's catalogue 'operations', 'padded_positions_from_start'): a left-padded batch whose
    positions count from the padded start (every row numbered as if it had no pads)."""

    def padded_positions(self, mask, n):
        width = mask.shape[1]
        return torch.arange(width - n, width).repeat(mask.shape[0], 1)
'''


def _window_patch() -> str:
    from kvfast.bugs.hf import HF_WINDOW

    return _WINDOW.format(window=HF_WINDOW)


#: ``{(catalogue, bug): the script's patch}`` for every bug a script can carry.
PATCHES: dict[tuple[str, str], object] = {
    ("hf", "posoff"): _POSOFF,
    ("hf", "restart"): _RESTART,
    ("hf", "replay"): _REPLAY,
    ("hf", "window"): _window_patch,
    ("hf", "freeze"): _FREEZE,
    ("hf", "f16"): _F16,
    ("operations", "crop_short"): _CROP_SHORT,
    ("operations", "window_evicts_one_too_many"): _WINDOW_EVICTS,
    ("operations", "fork_shared_keys"): _FORK_SHARED_KEYS,
    ("operations", "reorder_wrong_index"): _REORDER_WRONG_INDEX,
    ("operations", "reorder_keys_only"): _REORDER_KEYS_ONLY,
    ("operations", "padded_positions_from_start"): _PADDED_FROM_START,
}


def patch_for(bug: tuple[str, str] | None) -> str:
    """The script text that carries ``bug`` (``""`` for none); ``ValueError`` for a bug no script carries."""
    if bug is None:
        return ""
    found = PATCHES.get(tuple(bug))
    if found is None:
        allowed = ", ".join(f"{c}:{n}" for c, n in PATCHES)
        raise not_allowed("bug", f"{bug[0]}:{bug[1]}", f"a bug a standalone script can carry ({allowed})")
    return found() if callable(found) else found


def bug_of_adapter(adapter) -> tuple[str, str] | None:
    """``(catalogue, name)`` of the catalogue bug injected into ``adapter`` (by its mixins), ``None`` if clean.
    A bug injected otherwise than by a mixin (``static_never_cleared`` replaces ``new_cache``) is not seen."""
    from kvfast.bugs import hf as hf_bugs
    from kvfast.bugs import operations as op_bugs

    mixins = {
        op_bugs._CropShort: "crop_short",
        op_bugs._ForkSharedKeys: "fork_shared_keys",
        op_bugs._ReorderWrongIndex: "reorder_wrong_index",
        op_bugs._ReorderKeysOnly: "reorder_keys_only",
        op_bugs._PaddedPositionsFromStart: "padded_positions_from_start",
        op_bugs._WindowEvictsOneTooMany: op_bugs.WINDOW_BUG,
    }
    for cls in type(adapter).__mro__:
        if cls in mixins:
            return ("operations", mixins[cls])
        if issubclass(cls, hf_bugs._HFBug) and "bug" in vars(cls):
            return ("hf", cls.bug)
    return None
