"""``reorder`` (beam search; the hooks ``prefill_beams(tokens, n)``, ``decode_beams(tokens)`` and
``reorder(index)``): two beams, the first fed the shared tokens, the second others; before each of
:func:`reorder_points` the cache is reordered by ``[1, 0]`` and the beams swap slots. Each beam is judged
along its own lineage (its rows, whichever slot computed them): ``reorder`` and ``reorder-beam``."""

from __future__ import annotations

import numpy as np

from kvfast.check.protocol import ModelCalls, check_logits
from kvfast.check.scenarios.base import CachePath, Choose, Run, Scenario, draft_tokens, hook, shown

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
        rows = np.empty((2, steps, V))
        fed = np.empty((2, steps), dtype=np.int64)
        slot = [0, 1]  # slot[beam]: the batch row holding the beam's cache
        last = first[0][-1]
        points = reorder_points(steps)
        for t in range(1, steps + 1):
            fed[0, t - 1] = int(choose(t - 1, last))
            fed[1, t - 1] = int(draft_tokens(int(fed[0, t - 1]), 1, V)[0])
            if t in points:
                hook(calls, "reorder", np.array([1, 0], dtype=np.int64))
                slot = [1 - s for s in slot]
            batch = np.empty(2, dtype=np.int64)
            batch[slot[0]], batch[slot[1]] = fed[0, t - 1], fed[1, t - 1]
            out = check_logits(hook(calls, "decode_beams", batch), "decode_beams", 2, V, f"at step {t}")
            rows[0, t - 1], rows[1, t - 1] = out[slot[0]], out[slot[1]]
            last = rows[0, t - 1]
        note = f"two beams; the cache reordered by [1, 0] (the beams swap slots) before steps {shown(points)}"
        return Run(CachePath(first[0], rows[0], fed[0]), (note,), CachePath(first[1], rows[1], fed[1]))

    def branch_note(self, run: Run) -> str:
        return "the second beam: its own tokens, against the recompute of the prompt plus them"
