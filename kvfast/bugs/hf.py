"""Cache bugs injected into a Hugging Face model's cache path (:class:`~kvfast.check.hf.HFModel`): the recompute
and the order-noise variants stay clean. Each is a mixin over the adapter's hooks (:mod:`kvfast.bugs.hf_mixins`,
the source a reproducer carries; :func:`inject_hf_bug`).

``HFModel(model)`` with bug ``"posoff"``: ``inject_hf_bug(HFModel(model), "posoff")`` (or
``HF_BUGS["posoff"].inject(HFModel(model))``). :func:`first_acting_step` says where each first acts.
"""

from __future__ import annotations

from kvfast.bugs import hf_mixins as mix
from kvfast.bugs.bug import Bug, Catalogue, mixin_injector
from kvfast.check.hf import HFModel

#: The window of the ``window`` bug (positions decode attends).
HF_WINDOW = mix.Window.window

_injector = mixin_injector(HFModel, "an HFModel (kvfast.check.hf)")


#: The Hugging Face cache bugs (the ``bug`` axis of the ``hf_matrix``, ``hf_score`` and ``hf_scan`` studies).
HF_BUGS = Catalogue(
    Bug(
        "window", "an unasked-for sliding window: decode attends only the last HF_WINDOW positions",
        lambda s, t, n, w: max(1, HF_WINDOW - t + 1), _injector(mix.Window),
    ),
    Bug(
        "posoff", "decode position off by one (position_ids one behind)",
        lambda s, t, n, w: 1, _injector(mix.PositionOff),
    ),
    Bug(
        "freeze", "the last layer's key frozen after step 1: later decode steps store step 1's key",
        lambda s, t, n, w: 2, _injector(mix.Freeze),
    ),
    Bug(
        "f16", "the cache round-tripped through float16 (every stored key and value)",
        # the resumed chunk reads the first chunk's rounded keys
        lambda s, t, n, w: 0 if s == "resume" else 1, _injector(mix.Float16), logic=False,
    ),
    Bug(
        "restart", "a resume restarts positions at the first chunk's length (decode position = prefill length + "
        "tokens decoded, so extend() is not counted)",
        lambda s, t, n, w: 1 if s == "resume" else None, _injector(mix.Restart),
    ),
    Bug(
        "replay", "a token appended twice: extend() first re-appends the last token already in the cache",
        lambda s, t, n, w: 0 if s == "resume" else None, _injector(mix.Replay),
    ),
)  # fmt: skip
#: Bugs of the cache's logic (positions, eviction, growth, resume offsets); ``f16`` is a precision bug.
HF_LOGIC_BUGS = tuple(name for name, bug in HF_BUGS.items() if bug.logic)


#: ``first_acting_step(bug, scenario, prompt_len)``: the first step at which ``bug`` changes the cache path's logits
#: in ``scenario`` (``None``: never).
first_acting_step = HF_BUGS.first_acting_step
#: ``inject_hf_bug(adapter, bug)``: the :class:`~kvfast.check.hf.HFModel` ``adapter`` with cache bug ``bug`` of
#: :data:`HF_BUGS` (``None``: clean, unchanged), in place and returned.
inject_hf_bug = HF_BUGS.inject
