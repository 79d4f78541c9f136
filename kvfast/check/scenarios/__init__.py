"""The scenarios a check can run, one unit each, and their registry.

A scenario is a :class:`~kvfast.check.scenarios.base.Scenario`: it declares the hooks it needs from the model
under test, says whether it can run, and runs its cache path. Adding one is a unit (a module here) and one
line in :data:`REGISTRY`; the options, the command line, the pipeline and the report take it from there.

- ``decode``, ``resume`` (the default scenarios);
- the cache operations real inference stacks use, asked for by name: ``rollback`` (``crop``), ``fork``
  (``snapshot``/``restore``), ``reorder`` (beams) and ``padded`` (a left-padded batch). Each is defined by
  what it must equal: a full recompute of the tokens the cache logically holds; each feeds ``decode`` the same
  tokens as the ``decode`` scenario, so step ``t`` is still position ``T + t - 1``.

A model without a scenario's hooks, or whose hook raises ``NotImplementedError`` (a cache kind that cannot roll
back), gets the scenario reported as ``skipped`` with a note; any other exception of the model's is
:class:`~kvfast.check.protocol.ModelUnderTestError`.
"""

from __future__ import annotations

from kvfast.check.scenarios.base import Run, Scenario, Unsupported
from kvfast.check.scenarios.decode import Decode
from kvfast.check.scenarios.fork import BRANCH, Fork
from kvfast.check.scenarios.padded import Padded, padded_prompt
from kvfast.check.scenarios.reorder import Reorder
from kvfast.check.scenarios.resume import Resume
from kvfast.check.scenarios.rollback import Rollback

#: Every scenario by name, in the order a check runs them. One line per scenario.
REGISTRY: dict[str, Scenario] = {
    s.name: s
    for s in (
        Decode(),
        Resume(),
        Rollback(),
        Fork(),
        Reorder(),
        Padded(),
    )
}


def branches() -> dict[str, str]:
    """``{branch report name: its scenario's name}`` (``fork-branch``: ``fork``, ...)."""
    return {s.branch: name for name, s in REGISTRY.items() if s.branch is not None}


__all__ = [
    "BRANCH",
    "REGISTRY",
    "Run",
    "Scenario",
    "Unsupported",
    "branches",
    "padded_prompt",
]
