"""``resume``: prefill ``prompt[:split]``, then ``extend`` with the rest (or the rest through ``decode``, one token
at a time, when the model has no ``extend``), then decode. Step 0 judges the resumed chunk's rows only."""

from __future__ import annotations

import numpy as np

from kvfast.check.protocol import ModelCalls
from kvfast.check.scenarios.base import Choose, Run, Scenario, decode_steps


class Resume(Scenario):
    name = "resume"
    default = True

    def prompt_reason(self, prompt: np.ndarray) -> str | None:
        return "the prompt has one token and cannot be split in two chunks" if prompt.shape[0] < 2 else None

    def run(self, calls: ModelCalls, prompt: np.ndarray, split: int, steps: int, choose: Choose) -> Run:
        a = calls.prefill(prompt[:split], "of the first chunk (resume)")
        if calls.has("extend"):
            b = calls.extend(prompt[split:], "of the second chunk (resume)")
        else:
            where = [f"of prompt position {split + i} (resume)" for i in range(prompt.shape[0] - split)]
            b = np.stack([calls.decode(int(tok), at) for tok, at in zip(prompt[split:], where, strict=True)])
        return Run(decode_steps(calls, np.concatenate([a, b]), steps, choose))

    def first_row(self, split: int) -> int:
        return split

    def judged_notes(self, calls: ModelCalls, prompt: np.ndarray, split: int) -> tuple[str, ...]:
        notes = (
            f"step 0 judges the resumed chunk's rows {split}-{prompt.shape[0] - 1} only (the first chunk is a "
            "plain prefill, judged in the 'decode' scenario)",
        )
        if not calls.has("extend"):
            notes += ("the model has no extend(); the second chunk of the prompt went through decode()",)
        return notes
