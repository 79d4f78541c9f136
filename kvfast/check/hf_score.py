"""The anchors' cache tests scored on Hugging Face models: which detector finds which injected cache bug.

    python -m kvfast.check.hf_score [--seeds 2] [--prompts 2] [--steps 16]

Cases: tiny random Llama and GPT-2 (:func:`kvfast.check.hf.tiny_model`, sdpa) in
float32 and bfloat16, ``seeds`` x ``prompts`` (random prompts of 4 or 5 tokens, a
random continuation of ``steps`` tokens), each with every bug of
:data:`kvfast.check.hf.HF_BUGS` and clean (the controls). A detector gets the
model under test (:class:`~kvfast.check.hf.HFModel` with the case's bug) and the
case, and returns ``(flag, step)``.

Detectors:

- ``three_token_allclose``: three greedy tokens with the cache; decode step 1's
  logits against the recompute, ``torch.allclose(atol=1e-5, rtol=1e-5)`` (what
  popular generation test suites do);
- ``hf_logits_and_ids``: Hugging Face's own generation tests: greedy generation
  of ``steps`` tokens with and without the cache; per-step logits compared
  with ``allclose(atol=1e-5, rtol=1e-5)`` (``atol=rtol=1e-3`` for
  bfloat16, as its tests loosen for half precision) and token ids compared,
  both up to the first near-tie (a top-two gap of the recomputed logits
  below ``1e-3``, after which the ids may legitimately differ);
- ``kvfast_exact``: :func:`kvfast.check_cache`, exact mode, both scenarios;
- ``kvfast_control``: control mode, both scenarios, with the given continuation; flags ``bug``;
- ``kvfast_promoted``: control mode plus the float64 logic check; flags a ``bug`` in either.

Per bug: recall (flagged bugged cases / bugged cases) and the median step at
which flagged cases fired; over the clean controls: the false-positive rate.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import numpy as np

from kvfast.check.checker import check_cache
from kvfast.check.hf import HF_BUGS, TINY_VOCAB, HFModel, tiny_model

ATOL = {"float32": 1e-5, "float64": 1e-5, "bfloat16": 1e-3}
NEAR_TIE = 1e-3


def _np(logits) -> np.ndarray:
    return logits.detach().float().numpy().astype(np.float64) if hasattr(logits, "detach") else np.asarray(logits)


def three_token_allclose(model: HFModel, prompt: np.ndarray, continuation: np.ndarray) -> tuple[bool, int | None]:
    import torch

    first = model.prefill(prompt)
    token = int(torch.as_tensor(first)[-1].argmax())
    step1 = model.decode(token)
    model.decode(int(torch.as_tensor(step1).argmax()))
    reference = model.recompute(np.concatenate([prompt, [token]]))[-1]
    close = np.allclose(_np(step1), _np(reference), atol=1e-5, rtol=1e-5)
    return (not close), (None if close else 1)


def hf_logits_and_ids(model: HFModel, prompt: np.ndarray, continuation: np.ndarray) -> tuple[bool, int | None]:
    steps = continuation.shape[0]
    atol = ATOL.get(model.dtype, 1e-5)
    out = _np(model.prefill(prompt))[-1]
    seq = list(prompt)
    for t in range(1, steps + 1):
        full = _np(model.recompute(np.asarray(seq)))[-1]
        top = np.sort(full)[-2:]
        if top[1] - top[0] < NEAR_TIE:  # a near tie: HF stops comparing ids (and logits) here
            return False, None
        if not np.allclose(out, full, atol=atol, rtol=atol) or int(np.argmax(out)) != int(np.argmax(full)):
            return True, t - 1
        token = int(np.argmax(full))
        seq.append(token)
        out = _np(model.decode(token))
    return False, None


def kvfast_exact(model: HFModel, prompt: np.ndarray, continuation: np.ndarray) -> tuple[bool, int | None]:
    report = check_cache(model, prompt, continuation=continuation)
    return (not report.passed), report.first_divergent_step


def kvfast_control(model: HFModel, prompt: np.ndarray, continuation: np.ndarray) -> tuple[bool, int | None]:
    report = check_cache(model, prompt, mode="control", continuation=continuation)
    return report.verdict == "bug", report.first_bug_step


def kvfast_promoted(model: HFModel, prompt: np.ndarray, continuation: np.ndarray) -> tuple[bool, int | None]:
    report = check_cache(model, prompt, mode="control", continuation=continuation, promote="float64")
    steps = [r.first_bug_step for r in (report, report.promoted) if r.first_bug_step is not None]
    return bool(steps), (min(steps) if steps else None)


DETECTORS = {
    "three_token_allclose": three_token_allclose,
    "hf_logits_and_ids": hf_logits_and_ids,
    "kvfast_exact": kvfast_exact,
    "kvfast_control": kvfast_control,
    "kvfast_promoted": kvfast_promoted,
}


def score(seeds: int = 2, prompts: int = 2, steps: int = 16, dtypes=("float32", "bfloat16")) -> list[dict]:
    """One row per (detector, bug or ``None``, dtype): cases, flagged, recall or FPR, median step."""
    import torch

    torch.set_num_threads(1)
    results: dict[tuple, list] = {}
    for family, dtype in itertools.product(("llama", "gpt2"), dtypes):
        for seed in range(seeds):
            model = tiny_model(family, dtype, "sdpa", seed)
            rng = np.random.default_rng(2000 + seed)
            for k in range(prompts):
                prompt = rng.integers(0, TINY_VOCAB, 4 + k % 2)
                continuation = rng.integers(0, TINY_VOCAB, steps)
                for bug in (None, *HF_BUGS):
                    for name, detector in DETECTORS.items():
                        flag, step = detector(HFModel(model, bug=bug), prompt, continuation)
                        results.setdefault((name, bug, dtype), []).append((flag, step))
    rows = []
    for (name, bug, dtype), got in results.items():
        flagged = [s for f, s in got if f]
        steps_fired = [s for s in flagged if s is not None]
        rows.append({
            "detector": name, "bug": bug or "clean", "dtype": dtype, "cases": len(got), "flagged": len(flagged),
            "rate": len(flagged) / len(got), "step": statistics.median(steps_fired) if steps_fired else None,
        })  # fmt: skip
    return rows


def markdown(rows: list[dict]) -> str:
    """Recall (FPR for clean) and median step per bug and dtype, one column per detector."""
    names = list(DETECTORS)
    keys = list(dict.fromkeys((r["bug"], r["dtype"]) for r in rows))
    cell = {(r["detector"], r["bug"], r["dtype"]): r for r in rows}
    lines = [
        "| bug | dtype | cases | " + " | ".join(names) + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    for bug, dtype in keys:
        parts = []
        for n in names:
            r = cell[(n, bug, dtype)]
            step = "-" if r["step"] is None else f"{r['step']:g}"
            parts.append(f"{r['rate']:.2f}" + ("" if bug == "clean" else f", {step}"))
        label = "clean (FPR)" if bug == "clean" else bug
        lines.append(f"| {label} | {dtype} | {cell[(names[0], bug, dtype)]['cases']} | " + " | ".join(parts) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args(argv)
    print(f"python -m kvfast.check.hf_score --seeds {args.seeds} --prompts {args.prompts} --steps {args.steps}\n")
    print(markdown(score(args.seeds, args.prompts, args.steps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
