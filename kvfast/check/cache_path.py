"""The path under test: fill the cache for the prompt (one scenario's way), then decode step by step.

The cache operations' paths (``rollback``, ``fork``) live in :mod:`kvfast.check.operations`, which
registers them in :data:`OPERATION_PATHS`; :func:`run_cache_path` runs them too, so the reference's
fast path can be fed by (and reuse) an operation's run when no plain scenario is asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from kvfast.check.calls import ModelCalls


class Unsupported(Exception):  # noqa: N818 - a hook the model declines, not an error of the check
    """A model's operation hook raised ``NotImplementedError``: its scenario is skipped, ``str(self)`` the note."""


#: ``{scenario: runner(calls, prompt, steps, choose) -> a run with CachePath's fields}``, filled by
#: :mod:`kvfast.check.operations` when it is imported (it imports this module, never the reverse).
OPERATION_PATHS: dict[str, Callable] = {}


class CachePath(NamedTuple):
    """One run of the cache path: ``prompt_rows`` ``(T, V)`` (the prompt's logits, as the scenario filled
    the cache), ``decoded`` ``(steps, V)`` (decode step ``t``'s logits in row ``t - 1``) and ``fed``
    ``(steps,)`` (the token fed at each decode step)."""

    prompt_rows: np.ndarray
    decoded: np.ndarray
    fed: np.ndarray

    def logits(self) -> np.ndarray:
        """Every logits row of the run, ``(T + steps, V)``."""
        return np.concatenate([self.prompt_rows, self.decoded])


def run_cache_path(
    calls: ModelCalls,
    scenario: str,
    prompt: np.ndarray,
    split: int,
    steps: int,
    choose: Callable[[int, np.ndarray], int],
) -> CachePath:
    """Fill the cache for the prompt as ``scenario`` does, then decode ``steps`` tokens.

    ``decode``: ``prefill(prompt)``. An operation (:data:`OPERATION_PATHS`): its own path (a plain decode
    run when the model declines the operation). ``resume``: ``prefill(prompt[:split])``, then ``extend`` with the
    rest (or the rest through ``decode``, one token at a time, if the model has no ``extend``).
    ``choose(t, logits)`` gives the token fed at decode step ``t + 1`` from the cache's logits of step
    ``t`` (step 0: the prompt's last row).
    """
    if scenario in OPERATION_PATHS:
        try:
            return OPERATION_PATHS[scenario](calls, prompt, steps, choose)
        except Unsupported:  # the reference's run needs only tokens; the scenario itself reports the skip
            return run_cache_path(calls, "decode", prompt, split, steps, choose)
    T = prompt.shape[0]
    if scenario == "decode":
        first = calls.prefill(prompt, "of the prompt")
    else:
        a = calls.prefill(prompt[:split], "of the first chunk (resume)")
        if calls.has("extend"):
            b = calls.extend(prompt[split:], "of the second chunk (resume)")
        else:
            b = np.stack(
                [
                    calls.decode(int(tok), f"of prompt position {split + i} (resume)")
                    for i, tok in enumerate(prompt[split:])
                ]
            )
        first = np.concatenate([a, b])
    decoded = np.empty((steps, calls.vocab))
    fed = np.empty(steps, dtype=np.int64)
    last = first[-1]
    for t in range(1, steps + 1):
        tok = int(choose(t - 1, last))
        fed[t - 1] = tok
        last = calls.decode(tok, f"at step {t} (position {T + t - 1})")
        decoded[t - 1] = last
    return CachePath(first, decoded, fed)
