"""The anchors' cache tests scored on Hugging Face models: which detector finds which injected cache bug.

    python -m kvfast.check.hf_score [--seeds 2] [--prompts 2] [--steps 16]

Scored through the one scoring path, :func:`kvfast.check.score.compare_detectors`
(recall, median steps to detection, ROC AUC and the false-positive rate, as for
kvfast's own models), over :class:`HFCase` objects: tiny random Llama, GPT-2,
Mistral (sliding window) and Qwen2 (:func:`kvfast.check.hf.tiny_model`, sdpa) in
float32 and bfloat16, ``seeds`` x
``prompts`` (random prompts of 4 or 5 tokens, a random continuation of ``steps``
tokens), each with every bug of :data:`kvfast.check.hf.HF_BUGS` and clean (the
controls). Each dtype is scored on its own (its bugs against its own clean
controls). A detector gets the model under test (:class:`~kvfast.check.hf.HFModel`
with the case's bug) and the case, and returns a :class:`~kvfast.check.score.Detection`.

Detectors (:data:`DETECTORS`; the score ranks cases for the AUC):

- ``three_token_allclose``: three greedy tokens with the cache; decode step 1's
  logits against the recompute, ``allclose(atol=1e-5, rtol=1e-5)`` (what popular
  generation test suites do); score: the largest deviation at step 1;
- ``hf_logits_and_ids``: Hugging Face's own generation tests: greedy generation
  of ``steps`` tokens with and without the cache; per-step logits compared with
  ``allclose(atol=1e-5, rtol=1e-5)`` (``atol=rtol=1e-3`` for bfloat16, as its
  tests loosen for half precision) and token ids compared, both up to the first
  near-tie (a top-two gap of the recomputed logits below ``1e-3``, after which the
  ids may legitimately differ); score: the largest deviation compared;
- ``kvfast_exact``: :func:`kvfast.check_cache`, exact mode, both scenarios, the
  case's continuation; score: the largest deviation;
- ``kvfast_control``: control mode, both scenarios; flags ``bug``; score: the largest ratio;
- ``kvfast_promoted``: control mode plus the float64 logic check; flags a ``bug``
  in either; score: the larger of the two largest ratios.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from kvfast.check.checker import check_cache
from kvfast.check.hf import FAMILIES, HF_BUGS, TINY_VOCAB, HFModel, tiny_model
from kvfast.check.score import Detection, compare_detectors, markdown

ATOL = {"float32": 1e-5, "float64": 1e-5, "bfloat16": 1e-3}
NEAR_TIE = 1e-3
DTYPES = ("float32", "bfloat16")


@functools.lru_cache(maxsize=32)
def _base_model(family: str, dtype: str, attention: str, seed: int):
    """One tiny model per (family, dtype, attention, seed), shared by its cases (the adapter never changes it)."""
    return tiny_model(family, dtype, attention, seed)


@dataclass(frozen=True, eq=False)
class HFCase:
    """One scored case (:class:`kvfast.check.score.Case`): a tiny model, a prompt, a continuation, a bug or ``None``."""

    family: str
    dtype: str
    seed: int
    prompt_id: int
    bug: str | None
    prompt: np.ndarray
    continuation: np.ndarray
    attention: str = "sdpa"
    config: dict = field(init=False)

    def __post_init__(self) -> None:
        config = {"family": self.family, "dtype": self.dtype, "attention": self.attention, "seed": self.seed,
                  "prompt": self.prompt_id, "bug": self.bug or "none"}  # fmt: skip
        object.__setattr__(self, "config", config)

    @property
    def steps(self) -> int:
        return int(self.continuation.shape[0])

    def model(self) -> HFModel:
        """A fresh adapter with the case's bug over the (shared, never modified) tiny model."""
        return HFModel(_base_model(self.family, self.dtype, self.attention, self.seed), bug=self.bug)


def cases(seeds: int = 2, prompts: int = 2, steps: int = 16, families=FAMILIES, dtypes=DTYPES) -> list[HFCase]:
    """Every (family, dtype, seed, prompt) with every bug of :data:`HF_BUGS` and clean; deterministic."""
    out = []
    for family in families:
        for dtype in dtypes:
            for seed in range(seeds):
                rng = np.random.default_rng(2000 + seed)
                for k in range(prompts):
                    prompt = rng.integers(0, TINY_VOCAB, 4 + k % 2)
                    continuation = rng.integers(0, TINY_VOCAB, steps)
                    out += [HFCase(family, dtype, seed, k, bug, prompt, continuation) for bug in (None, *HF_BUGS)]
    return out


def _np(logits) -> np.ndarray:
    return logits.detach().double().numpy() if hasattr(logits, "detach") else np.asarray(logits, dtype=np.float64)


def three_token_allclose(model: HFModel, case: HFCase) -> Detection:
    """Three greedy tokens with the cache; decode step 1's logits against the recompute, allclose(1e-5)."""
    first = _np(model.prefill(case.prompt))[-1]
    token = int(np.argmax(first))
    step1 = _np(model.decode(token))
    model.decode(int(np.argmax(step1)))
    reference = _np(model.recompute(np.append(case.prompt, token)))[-1]
    close = np.allclose(step1, reference, atol=1e-5, rtol=1e-5)
    return Detection(not close, float(np.abs(step1 - reference).max()), None if close else 1)


def hf_logits_and_ids(model: HFModel, case: HFCase) -> Detection:
    """Greedy with and without the cache; per-step allclose logits and equal ids, up to the first near-tie."""
    atol = ATOL.get(model.dtype, 1e-5)
    out = _np(model.prefill(case.prompt))[-1]
    seq = list(case.prompt)
    largest = 0.0
    for t in range(1, case.steps + 1):
        full = _np(model.recompute(np.asarray(seq)))[-1]
        top = np.sort(full)[-2:]
        if top[1] - top[0] < NEAR_TIE:  # a near tie: HF stops comparing ids (and logits) here
            break
        largest = max(largest, float(np.abs(out - full).max()))
        if not np.allclose(out, full, atol=atol, rtol=atol) or int(np.argmax(out)) != int(np.argmax(full)):
            return Detection(True, largest, t - 1)
        token = int(np.argmax(full))
        seq.append(token)
        out = _np(model.decode(token))
    return Detection(False, largest, None)


def kvfast_exact(model: HFModel, case: HFCase) -> Detection:
    report = check_cache(model, case.prompt, continuation=case.continuation)
    return Detection(not report.passed, report.max_deviation, report.first_divergent_step)


def kvfast_control(model: HFModel, case: HFCase) -> Detection:
    report = check_cache(model, case.prompt, mode="control", continuation=case.continuation)
    return Detection(report.verdict == "bug", report.max_ratio, report.first_bug_step)


def kvfast_promoted(model: HFModel, case: HFCase) -> Detection:
    report = check_cache(model, case.prompt, mode="control", continuation=case.continuation, promote="float64")
    both = (report, report.promoted)
    steps = [r.first_bug_step for r in both if r.first_bug_step is not None]
    return Detection(bool(steps), max(r.max_ratio for r in both), min(steps) if steps else None)


DETECTORS = {
    "three_token_allclose": three_token_allclose,
    "hf_logits_and_ids": hf_logits_and_ids,
    "kvfast_exact": kvfast_exact,
    "kvfast_control": kvfast_control,
    "kvfast_promoted": kvfast_promoted,
}


def score(all_cases: list[HFCase], detectors: dict | None = None) -> pd.DataFrame:
    """:func:`~kvfast.check.score.compare_detectors` per dtype (its bugs against its own clean controls),
    stacked, with a ``dtype`` column after ``bug``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        parts = []
        for dtype in dict.fromkeys(c.dtype for c in all_cases):
            part = compare_detectors(detectors or DETECTORS, [c for c in all_cases if c.dtype == dtype], HF_BUGS)
            part.insert(1, "dtype", dtype)
            parts.append(part)
    finally:
        torch.set_num_threads(threads)
    return pd.concat(parts, ignore_index=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args(argv)
    table = score(cases(args.seeds, args.prompts, args.steps))
    print(f"python -m kvfast.check.hf_score --seeds {args.seeds} --prompts {args.prompts} --steps {args.steps}\n")
    print(markdown(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
