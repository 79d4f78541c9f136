"""The cache operations' bug catalogue scored against the detectors people write (extra ``kvfast[hf]``).

    python -m kvfast.studies.op_score [--steps 16]

Cases: the tiny random Llama, GPT-2, Qwen2 and Mistral (float32, sdpa, weight seed 0) over a ``StaticCache``
of 512 positions (a cache that writes its keys in place, where a shared key tensor acts), the hf_score
study's first two prompts with their continuations, each with one bug of
:data:`kvfast.bugs.operations.OP_BUGS` injected into the cache path (``inject_op_bug``) or clean. The
sliding-window bug (``window_evicts_one_too_many``) needs a window: it is scored on Mistral (a window of
:data:`kvfast.testing.MISTRAL_WINDOW`), which carries it and clean controls only; the other bugs on the
three families without a window (:func:`bugs_of`).
Detectors, each scored through the path of :func:`kvfast.bugs.score.score_detector` (``run_detector``
then ``score_rows``: recall, median steps to detection, ROC AUC, false-positive rate on the clean cases),
each group of families' bugs against that group's clean cases (:func:`grouped_scores`):

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
import pandas as pd

from kvfast.bugs.operations import OP_BUGS, WINDOW_BUG, inject_op_bug
from kvfast.bugs.score import Detection, markdown, run_detector, score_rows, side_by_side
from kvfast.check.checker import check_cache
from kvfast.studies.common import declared_order
from kvfast.studies.hf_score import DETECTORS, PromptOfConfig

FAMILIES = ("llama", "gpt2", "qwen2", "mistral")
WINDOWED = ("mistral",)  # the families with a sliding window
PROMPTS = (0, 1)
CACHE_LEN = 512  # room for the never-cleared static cache's later prefills
SCENARIOS = ("decode", "rollback", "fork", "reorder", "padded")


@dataclass(frozen=True, eq=False)
class OpCase(PromptOfConfig):
    """One scored case (:class:`kvfast.bugs.score.Case`): a tiny model over a ``StaticCache``, a prompt, its
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
    """Every family x prompt x (clean and each operation bug of :func:`bugs_of` the family)."""
    out = []
    for family in FAMILIES:
        for prompt in PROMPTS:
            config = {"family": family, "seed": 0, "prompt": prompt, "steps": steps}
            out += [OpCase(config, bug) for bug in (None, *bugs_of(family))]
    return out


def bugs_of(family: str) -> tuple[str, ...]:
    """The operation bugs scored on ``family``: the sliding-window bug on a family with a window (and only it,
    so the other bugs' rows stay on the families without one), every other bug elsewhere."""
    if family in WINDOWED:
        return (WINDOW_BUG,)
    return tuple(b for b in OP_BUGS if b != WINDOW_BUG)


def score_table(steps: int = 16) -> str:
    """The Markdown table: each detector's scores per operation bug, side by side."""
    baselines = ("three_token_allclose", "hf_logits_and_ids")
    detectors = {**{name: DETECTORS[name] for name in baselines}, "kvfast_operations": kvfast_operations}
    all_cases = cases(steps)
    tables = {name: grouped_scores(run_detector(fn, all_cases, tuple(OP_BUGS))) for name, fn in detectors.items()}
    return markdown(side_by_side(tables))


def grouped_scores(detections: pd.DataFrame) -> pd.DataFrame:
    """:func:`~kvfast.bugs.score.score_rows` per group of families (with and without a window), each group's
    bugs against its own clean controls (a bug is never ranked against another architecture's clean scores),
    then the ``all`` row over every case; rows in :data:`OP_BUGS`' order."""
    bugs = tuple(OP_BUGS)
    windowed = detections["family"].isin(WINDOWED)
    parts = [score_rows(detections[group], bugs) for group in (~windowed, windowed) if group.any()]
    rows = pd.concat([p[p["bug"] != "all"] for p in parts] + [score_rows(detections, bugs).tail(1)])
    return rows.sort_values("bug", key=declared_order({"bug": (*bugs, "all")}), kind="stable").reset_index(drop=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    print(f"operation bugs, {', '.join(FAMILIES)} x {len(PROMPTS)} prompts, {args.steps} steps, StaticCache")
    print(score_table(args.steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
