"""``decode``: prefill the prompt, then decode step by step."""

from __future__ import annotations

import numpy as np

from kvfast.check.protocol import ModelCalls
from kvfast.check.scenarios.base import Choose, Run, Scenario, decode_steps


class Decode(Scenario):
    name = "decode"
    default = True

    def run(self, calls: ModelCalls, prompt: np.ndarray, split: int, steps: int, choose: Choose) -> Run:
        return Run(decode_steps(calls, calls.prefill(prompt, "of the prompt"), steps, choose))
