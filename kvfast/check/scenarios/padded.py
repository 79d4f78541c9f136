"""``padded`` (batched generation; the hooks ``prefill_padded(prompts)`` and ``decode_padded(tokens)``): the
prompt and :func:`padded_prompt` as one left-padded batch (mask and positions as ``generate`` builds them), then
one token per row per step; each row is judged against its own unpadded recompute: ``padded`` and
``padded-row``."""

from __future__ import annotations

import numpy as np

from kvfast.check.protocol import ModelCalls, check_logits
from kvfast.check.scenarios.base import Choose, Run, Scenario, decode_pair, hook


def padded_prompt(prompt: np.ndarray, vocab: int) -> np.ndarray:
    """The padded scenario's other prompt: two tokens shorter than ``prompt`` (two longer for a prompt of one
    or two tokens), so one of the rows is left-padded."""
    T = prompt.shape[0]
    n = T - 2 if T > 2 else T + 2
    return (prompt[np.arange(n) % T] * 3 + 1 + np.arange(n)) % vocab


class Padded(Scenario):
    name = "padded"
    hooks = ("prefill_padded", "decode_padded")
    branch = "padded-row"

    def run(self, calls: ModelCalls, prompt: np.ndarray, split: int, steps: int, choose: Choose) -> Run:
        V = calls.vocab
        other = padded_prompt(prompt, V)
        raw = hook(calls, "prefill_padded", [prompt.copy(), other.copy()])
        first = [
            check_logits(raw[i], "prefill_padded", p.shape[0], V, f"row {i}") for i, p in enumerate((prompt, other))
        ]
        pad = abs(prompt.shape[0] - other.shape[0])
        row = "second" if other.shape[0] < prompt.shape[0] else "first"
        note = (
            f"a left-padded batch of two prompts ({prompt.shape[0]} and {other.shape[0]} tokens; the {row} row has "
            f"{pad} pads), mask and positions as generate builds them"
        )

        def decode_rows(t: int, tokens: np.ndarray) -> np.ndarray:
            return check_logits(hook(calls, "decode_padded", tokens), "decode_padded", 2, V, f"at step {t}")

        return decode_pair(calls, first, steps, choose, decode_rows, note)

    def branch_prompt(self, prompt: np.ndarray, vocab: int) -> np.ndarray:
        return padded_prompt(prompt, vocab)

    def branch_note(self, run: Run) -> str:
        return "the padded batch's other row: its own prompt and tokens, against their unpadded recompute"
