"""One bug of a catalogue, in one shape: :class:`Bug` (name, description, where it first acts, how it is injected),
and a catalogue of them, :class:`Catalogue` (its bugs by name: each catalogue's ``inject_*_bug`` is its
:meth:`Catalogue.inject`).

A bug is injected into a model under test by subclassing its adapter (:func:`subclass_with`): a small mixin
overrides the adapter's hooks (``HFModel._decode_positions``, ``KvfastModel._crop_keep``, ...), so the product
adapters hold no ``if bug == ...`` branch. kvfast's own model's bugs are one changed line each inside the
model's decode kernel (:mod:`kvfast.model.bugs`): injecting one selects it by name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from kvfast.validation import require_choice

#: ``acts(scenario, prompt_len, steps, window)``: the first step at which a bug changes that scenario's cache
#: path logits (step 0: the prompt's rows), ``None`` where it never does. A catalogue reads what it needs.
Acts = Callable[[str, "int | None", "int | None", "int | None"], "int | None"]


@dataclass(frozen=True)
class Bug:
    """One catalogued cache bug.

    - ``name``: its name in its catalogue (a study's ``bug`` axis value).
    - ``description``: what the bug does, in one sentence.
    - ``acts``: where it first acts (see :data:`Acts`; :meth:`first_acting_step`).
    - ``inject``: ``inject(model) -> model``: the model under test with the bug (an adapter of the kind the
      catalogue names; in place where the adapter allows it, and returned).
    - ``logic``: a bug of the cache's logic (positions, eviction, growth, offsets); ``False``: a precision bug.
    """

    name: str
    description: str
    acts: Acts
    inject: Callable[[object], object]
    logic: bool = True

    def first_acting_step(
        self, scenario: str, prompt_len: int | None = None, steps: int | None = None, window: int | None = None
    ) -> int | None:
        """The first step at which this bug changes ``scenario``'s cache path logits (``None``: never)."""
        return self.acts(scenario, prompt_len, steps, window)


class Catalogue(dict[str, Bug]):
    """A catalogue: its bugs by name, in the order given (``Catalogue(bug, ...)``), each injected into the kind of
    adapter the catalogue names. ``field``: what :meth:`inject` names an unknown bug as (``"bug"``)."""

    def __init__(self, *bugs: Bug, field: str = "bug"):
        super().__init__((bug.name, bug) for bug in bugs)
        self.field = field

    def inject(self, model: object, bug: str | None) -> object:
        """``model`` with this catalogue's bug ``bug`` (``None``: clean, unchanged), in place and returned; an
        unknown name is a ``ValueError`` naming :attr:`field` and the catalogue's names."""
        if bug is None:
            return model
        require_choice(bug, self.field, self)
        return self[bug].inject(model)

    def first_acting_step(
        self,
        bug: str,
        scenario: str,
        prompt_len: int | None = None,
        steps: int | None = None,
        window: int | None = None,
    ) -> int | None:
        """The first step at which this catalogue's bug ``bug`` changes ``scenario``'s cache path logits (``None``:
        never), as :meth:`Bug.first_acting_step` says it. An unknown name is a ``ValueError``."""
        require_choice(bug, "bug", self)
        return self[bug].first_acting_step(scenario, prompt_len, steps, window)


def require_adapter(model: object, adapter: type | tuple[type, ...], allowed: str) -> object:
    """``model`` if it is an ``adapter``, else ``ValueError``: ``model: CLASS is not allowed; allowed: ALLOWED``."""
    if not isinstance(model, adapter):
        raise ValueError(f"model: {type(model).__name__} is not allowed; allowed: {allowed}")
    return model


def mixin_injector(adapter: type | tuple[type, ...], allowed: str) -> Callable[[type], Callable[[object], object]]:
    """``injector(mixin)`` for a catalogue of ``adapter``'s bugs (a class, or a tuple of classes that share the
    hooks): it gives ``inject(model)``, which turns an ``adapter`` into one with ``mixin`` in front
    (:func:`subclass_with`) and refuses anything else (:func:`require_adapter`)."""
    return lambda mixin: lambda model: subclass_with(require_adapter(model, adapter, allowed), mixin)


def subclass_with(model: object, mixin: type) -> object:
    """``model`` turned, in place, into an instance of its class with ``mixin`` in front (the mixin's methods
    override the adapter's hooks); returned. The new class keeps the adapter's name, so reports and error
    messages name the adapter as before."""
    model.__class__ = _with_mixin(type(model), mixin)
    return model


@functools.cache
def _with_mixin(base: type, mixin: type) -> type:
    return type(base.__name__, (mixin, base), {"__module__": mixin.__module__, "__qualname__": base.__qualname__})
