"""``rollback`` (speculative decoding, assisted generation; the model's ``crop(n)`` hook: keep the first ``n``
positions).

Defined by what it must equal: a full recompute of the tokens the cache logically holds. Before decode step
``t = 1, 1 + ROLLBACK_EVERY, ...`` the cache takes ``k`` draft tokens (``k`` cycles through :data:`DRAFTS`;
tokens the shared text does not hold), then ``crop(T + t - 1)`` drops them again and step ``t`` decodes the
kept token. Right after the prefill the scenario calls ``crop(T)``, a rollback of nothing, where a model may
prepare for rollbacks (a Hugging Face cache starts recording its past there, as ``generate`` does after its
prefill). Every step after a rollback must equal the recompute of the kept prefix plus the tokens after it:
a crop that keeps one draft too many shows at the first step after the first rollback. The drafts' own
logits are not judged.
"""

from __future__ import annotations

import numpy as np

from kvfast.check.protocol import ModelCalls
from kvfast.check.scenarios.base import Choose, Run, Scenario, decode_steps, draft_tokens, hook, shown

#: Decode steps between two rollbacks (the first rollback comes before step 1).
ROLLBACK_EVERY = 4
#: Draft tokens taken before each rollback, in turn.
DRAFTS = (1, 2, 3)


def rollback_points(steps: int) -> list[int]:
    """The decode steps before which the rollback scenario drafts and crops."""
    return list(range(1, steps + 1, ROLLBACK_EVERY))


class Rollback(Scenario):
    name = "rollback"
    hooks = ("crop",)

    def run(self, calls: ModelCalls, prompt: np.ndarray, split: int, steps: int, choose: Choose) -> Run:
        T = prompt.shape[0]
        first = calls.prefill(prompt, "of the prompt")
        hook(calls, "crop", T)  # a rollback of nothing: where a model may prepare for rollbacks (HF: generate's way)
        points = rollback_points(steps)

        def draft_and_crop(t: int, token: int) -> None:
            k = DRAFTS[points.index(t) % len(DRAFTS)]
            for i, d in enumerate(draft_tokens(token, k, calls.vocab)):
                calls.decode(int(d), f"of draft token {i + 1} of {k} before step {t} (rollback)")
            hook(calls, "crop", T + t - 1)

        path = decode_steps(calls, first, steps, choose, dict.fromkeys(points, draft_and_crop))
        note = (
            f"{len(points)} rollbacks: before steps {shown(points)} the cache took {min(DRAFTS)}-{max(DRAFTS)} draft "
            "tokens and crop(n) kept the first n positions again; each step equals the recompute of the kept prefix "
            "and the tokens after it"
        )
        return Run(path, (note,))
