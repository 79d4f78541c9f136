"""The cache operations' bug catalogue scored against the detectors people write (extra ``kvfast[hf]``).

    python -m kvfast.studies.op_score [--steps 16]

Cases: the tiny random Llama, GPT-2 and Qwen2 (float32, sdpa, weight seed 0) over a ``StaticCache`` of 512
positions (a cache that writes its keys in place, where a shared key tensor acts), the hf_score study's
first two prompts with their continuations, each with one bug of
:data:`kvfast.check.operations.OP_BUGS` injected into the operation hooks (``inject_op_bug``) or clean.
Detectors, each scored through :func:`kvfast.check.score.score_detector` (recall, median steps to
detection, ROC AUC, false-positive rate on the clean cases):

- ``three_token_allclose`` and ``hf_logits_and_ids``: the hf_score study's two detectors people write
  (popular test suites' three-token ``allclose``; Hugging Face's per-step logits and ids);
- ``kvfast_operations``: :func:`kvfast.check_cache` in control mode over the scenarios ``decode``,
  ``rollback``, ``fork``, ``reorder`` and ``padded``; flags a ``bug``; score: the largest ratio.

``padded_positions_from_start`` acts on GPT-2 only (absolute positions): under rotary positions it shifts
every position of a row by one constant, which attention cannot see in exact arithmetic.

Prints one Markdown table (pasted into docs/check.md, section 10).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import numpy as np

from kvfast.check.checker import check_cache
from kvfast.check.operations import OP_BUGS, inject_op_bug
from kvfast.check.score import Detection, markdown, score_detector, side_by_side
from kvfast.studies.hf_score import PromptOfConfig

FAMILIES = ("llama", "gpt2", "qwen2")
PROMPTS = (0, 1)
CACHE_LEN = 512  # room for the never-cleared static cache's later prefills
SCENARIOS = ("decode", "rollback", "fork", "reorder", "padded")


@dataclass(frozen=True, eq=False)
class OpCase(PromptOfConfig):
    """One scored case (:class:`kvfast.check.score.Case`): a tiny model over a ``StaticCache``, a prompt, its
    continuation and an operation bug (``None``: clean)."""

    config: dict = field(hash=False)
    bug: str | None = None

    def model(self):
        """A fresh adapter over a ``StaticCache`` with the case's operation bug."""
        import transformers

        from kvfast.check.hf import HFModel
        from kvfast.studies import hf_common as hf

        c = self.config
        base = hf.base_model(c["family"], "float32", "sdpa", c["seed"])
        fresh = lambda: transformers.StaticCache(config=base.config, max_cache_len=CACHE_LEN)  # noqa: E731
        return inject_op_bug(HFModel(base, new_cache=fresh), self.bug)


def kvfast_operations(model, case: OpCase) -> Detection:
    """Control mode over every operation scenario and decode; flags ``bug``; score: the largest ratio. A check
    the model's own code ends (:class:`~kvfast.check.ModelUnderTestError`, ``kvfast check``'s exit 4: a
    never-cleared static cache overflows, or meets a batch of beams) flags too, with the largest score."""
    from kvfast.check import ModelUnderTestError

    try:
        report = check_cache(model, case.prompt, mode="control", continuation=case.continuation, scenarios=SCENARIOS)
    except ModelUnderTestError:
        return Detection(True, float(np.finfo(np.float64).max), None)
    return Detection(report.verdict == "bug", float(report.max_ratio), report.first_bug_step)


def cases(steps: int) -> list[OpCase]:
    """Every family x prompt x (clean and each operation bug)."""
    out = []
    for family in FAMILIES:
        for prompt in PROMPTS:
            config = {"family": family, "seed": 0, "prompt": prompt, "steps": steps}
            out += [OpCase(config, bug) for bug in (None, *OP_BUGS)]
    return out


def score_table(steps: int = 16) -> str:
    """The Markdown table: each detector's scores per operation bug, side by side."""
    from kvfast.studies.hf_score import hf_logits_and_ids, three_token_allclose

    detectors = {
        "three_token_allclose": three_token_allclose,
        "hf_logits_and_ids": hf_logits_and_ids,
        "kvfast_operations": kvfast_operations,
    }
    all_cases = cases(steps)
    tables = {name: score_detector(fn, all_cases, bugs=tuple(OP_BUGS)) for name, fn in detectors.items()}
    return markdown(side_by_side(tables))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    print(f"operation bugs, {len(FAMILIES)} families x {len(PROMPTS)} prompts, {args.steps} steps, StaticCache")
    print(score_table(args.steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
