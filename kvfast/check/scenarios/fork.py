"""``fork`` (prefix caching, parallel sampling, a prompt reused; the hooks ``snapshot() -> state`` and
``restore(state)``).

Prefill, ``s0 = snapshot()``; decode steps ``1..h`` (``h = steps // 2``), ``sh = snapshot()``; ``restore(s0)``
and decode a second branch of ``m = max(1, h)`` other tokens; ``restore(sh)`` and decode steps
``h + 1..steps``. Two reports: ``fork`` (the first branch: steps after ``h`` show whether the second branch
changed it) and ``fork-branch`` (the second branch against the recompute of the prompt plus its own
tokens). A snapshot that shares the key buffer with the live cache shows at step ``h + 1``.
"""

from __future__ import annotations

import numpy as np

from kvfast.check.protocol import ModelCalls
from kvfast.check.scenarios.base import CachePath, Choose, Run, Scenario, decode_steps, draft_tokens, hook

BRANCH = "fork-branch"  # the name of the fork scenario's second branch's report


class Fork(Scenario):
    name = "fork"
    hooks = ("snapshot", "restore")
    branch = BRANCH

    def run(self, calls: ModelCalls, prompt: np.ndarray, split: int, steps: int, choose: Choose) -> Run:
        T = prompt.shape[0]
        h, m = steps // 2, max(1, min(steps, steps // 2))
        first = calls.prefill(prompt, "of the prompt")
        at_prompt = hook(calls, "snapshot")
        branches = []

        def second_branch(t: int, token: int) -> None:  # before step h + 1, from the prompt's snapshot
            at_h = hook(calls, "snapshot")
            hook(calls, "restore", at_prompt)
            other = draft_tokens(int(choose(0, first[-1])), m, calls.vocab)
            where = [f"at step {i + 1} of the second branch (position {T + i})" for i in range(m)]
            branch = np.stack([calls.decode(int(tok), at) for tok, at in zip(other, where, strict=True)])
            branches.append(CachePath(first, branch, other))
            hook(calls, "restore", at_h)

        path = decode_steps(calls, first, steps, choose, {h + 1: second_branch})
        note = (
            f"snapshot after the prompt and after step {h}; a second branch of {m} tokens ran from the prompt's "
            f"snapshot, then restore() went back to step {h}: steps {h + 1}-{steps} show whether it changed this "
            "branch"
        )
        return Run(path, (note,), branches[0])

    def branch_note(self, run: Run) -> str:
        return (
            f"the second branch: {run.branch.fed.shape[0]} tokens decoded from the prompt's snapshot, against the "
            "recompute of the prompt plus its own tokens"
        )
