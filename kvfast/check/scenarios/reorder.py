"""``reorder`` (beam search; the hooks ``prefill_beams(tokens, n)``, ``decode_beams(tokens)`` and
``reorder(index)``): two beams, the first fed the shared tokens, the second others; before each of
:func:`reorder_points` the cache is reordered by ``[1, 0]`` and the beams swap slots. Each beam is judged
along its own lineage (its rows, whichever slot computed them): ``reorder`` and ``reorder-beam``."""

from __future__ import annotations

import numpy as np

from kvfast.check.protocol import ModelCalls, check_logits
from kvfast.check.scenarios.base import Choose, Run, Scenario, decode_pair, hook, shown

#: Decode steps before which the reorder scenario swaps its two beams (beam index ``[1, 0]``).
REORDER_EVERY = 4


def reorder_points(steps: int) -> list[int]:
    """The decode steps before which the reorder scenario swaps its beams (never before step 2: both beams
    hold the prompt alone until then, and a swap would change nothing)."""
    return list(range(2, steps + 1, REORDER_EVERY))


class Reorder(Scenario):
    name = "reorder"
    hooks = ("prefill_beams", "decode_beams", "reorder")
    branch = "reorder-beam"

    def run(self, calls: ModelCalls, prompt: np.ndarray, split: int, steps: int, choose: Choose) -> Run:
        T, V = prompt.shape[0], calls.vocab
        raw = hook(calls, "prefill_beams", prompt.copy(), 2)
        first = [check_logits(raw[b], "prefill_beams", T, V, f"beam {b} of the prompt") for b in range(2)]
        slot = [0, 1]  # slot[beam]: the batch row holding the beam's cache
        points = reorder_points(steps)

        def decode_rows(t: int, tokens: np.ndarray) -> np.ndarray:
            if t in points:
                hook(calls, "reorder", np.array([1, 0], dtype=np.int64))
                slot.reverse()  # (the beams swap slots)
            return check_logits(hook(calls, "decode_beams", tokens[slot]), "decode_beams", 2, V, f"at step {t}")[slot]

        note = f"two beams; the cache reordered by [1, 0] (the beams swap slots) before steps {shown(points)}"
        return decode_pair(calls, first, steps, choose, decode_rows, note)

    def branch_note(self, run: Run) -> str:
        return "the second beam: its own tokens, against the recompute of the prompt plus them"
