"""kvfast's own model's eight bugs (:data:`kvfast.model.bugs.BUGS`) as catalogue entries.

Each is one changed line of the model's decode kernel (:mod:`kvfast.model.generation`), selected by name
(``KvfastModel(..., bug=NAME)``); this module gives them the catalogue's shape (:class:`~kvfast.bugs.bug.Bug`):
where each first acts in the ``decode`` scenario (a prompt then greedy decode steps) and how it is injected.
The model's own tables (:data:`BUGS`: descriptions, :data:`VISIBLE_AT_STEP_1`, :data:`EVICT_WINDOW`) are
re-exported here, so the studies read every catalogue from :mod:`kvfast.bugs`. :func:`kvfast_model` builds
kvfast's model clean or with one of them: the built-in ``check`` study's factory.
"""

from __future__ import annotations

from kvfast.bugs.bug import Bug, Catalogue, require_adapter
from kvfast.check.adapters import KvfastModel
from kvfast.model.bugs import BUGS, EVICT_WINDOW, VISIBLE_AT_STEP_1, bug_code
from kvfast.model.config import ModelConfig, init_params
from kvfast.numerics import Numerics
from kvfast.validation import not_allowed, require_choice, require_int

__all__ = [
    "BUGS", "EVICT_WINDOW", "KVFAST_BUGS", "NO_BUG", "VISIBLE_AT_STEP_1", "first_acting_step", "kvfast_model",
    "tiny_model",
]  # fmt: skip

NO_BUG = "none"  # kvfast_model's (and the studies' grids') name for a clean model


def first_acting_step(bug: str, scenario: str, prompt_len: int) -> int:
    """The first decode step at which kvfast's bug ``bug`` changes the logits of the ``decode`` scenario (the
    only scenario this is stated for): step 1 for the four visible at step 1; ``evict`` where the cache plus
    the new token first exceed its window (``EVICT_WINDOW + 1 - prompt_len``); step 2 for the other growth
    bugs (the first step at which the cache holds a decoded entry or the position passes the prompt)."""
    require_choice(bug, "bug", BUGS)
    if scenario != "decode":
        raise not_allowed("scenario", scenario, "decode (where kvfast's own bugs' first acting steps are stated)")
    if VISIBLE_AT_STEP_1[bug]:
        return 1
    if bug == "evict":
        return max(1, EVICT_WINDOW + 1 - require_int(prompt_len, "prompt_len", 1))
    return 2


def _injector(name: str):
    def inject(model):
        """``model`` (a :class:`~kvfast.check.KvfastModel`) decoding with bug ``name``, in place."""
        require_adapter(model, KvfastModel, "a KvfastModel")
        model.bug, model.bug_code = name, bug_code(name)
        return model

    return inject


def _entry(name: str) -> Bug:
    return Bug(name, BUGS[name], lambda s, t, n, w: first_acting_step(name, s, t), _injector(name))


#: kvfast's own model's bugs, in :data:`kvfast.model.bugs.BUGS`' order.
KVFAST_BUGS = Catalogue(*(_entry(name) for name in BUGS))


def kvfast_model(
    seed: int,
    n_layer: int,
    n_head: int,
    d_model: int,
    d_ff: int,
    vocab: int,
    preset: str,
    order: str,
    attention: str,
    bug: str,
    max_pos: int = 256,
) -> KvfastModel:
    """kvfast's transformer with random parameters from ``seed``, in ``preset``/``order``/``attention``,
    with catalogue bug ``bug`` (:data:`NO_BUG`, ``"none"``: clean). The built-in ``check`` study's default
    factory: ``kvfast.studies.check:kvfast_model`` re-exports it; it lives here so that ``kvfast check`` builds
    kvfast's model without importing the studies (the sweep engine, pandas)."""
    cfg = ModelConfig(vocab=vocab, d_model=d_model, n_head=n_head, n_layer=n_layer, d_ff=d_ff, max_pos=max_pos)
    numerics = Numerics.preset(preset, order, attention)
    return KvfastModel(cfg, init_params(cfg, seed), numerics, bug=None if bug == NO_BUG else bug)


#: :func:`tiny_model`'s architecture: kvfast's model small enough to check in a second
TINY_CONFIG = ModelConfig(vocab=32, d_model=16, n_head=2, n_layer=2, d_ff=32, max_pos=128)


def tiny_model(bug: str | None = None, numerics: str = "f32", seed: int = 0) -> KvfastModel:
    """A random 2-layer kvfast model (:data:`TINY_CONFIG`, parameters from ``seed``) on its real decode path, in
    the preset ``numerics``, with the catalogue bug ``bug`` (:data:`kvfast.BUGS`; ``None`` or ``"none"``:
    clean). A factory for ``kvfast check`` that works from any directory::

        kvfast check kvfast.bugs.kvfast_model:tiny_model --prompt 1,2,3 --steps 64
        kvfast check kvfast.bugs.kvfast_model:tiny_model --factory-arg bug=posfrozen --prompt 1,2,3 --steps 64

    Bad arguments raise ``ValueError`` naming the field (``kvfast check``: exit 2)."""
    params = init_params(TINY_CONFIG, seed=require_int(seed, "seed", 0))
    return KvfastModel(TINY_CONFIG, params, numerics, bug=None if bug in (None, NO_BUG) else bug)
