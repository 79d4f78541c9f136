"""The measured matrix behind control mode's claims on Hugging Face models: false positives and misses.

    python -m kvfast.check.hf_matrix [--seeds 3] [--prompts 3] [--steps 24] [--padded]

Tiny random models from configs (:func:`kvfast.check.hf.tiny_model`: Llama,
GPT-2, Mistral with a sliding window, Qwen2; float32, float64, bfloat16; sdpa
and eager), ``seeds`` weight seeds x ``prompts`` random prompts (lengths 4 to
7) with a given random continuation of ``steps`` tokens, both scenarios:

- clean: control mode, plus one greedy run per model (no continuation); a
  false positive is a ``bug`` verdict; ``inconclusive`` is counted apart;
- every bug of :data:`kvfast.check.hf.HF_BUGS`: control mode in the model's
  own precision, and the logic check in float64 (``promote="float64"``); a
  miss is any verdict but ``bug``, and a catch at another step than the one
  where the bug first acts (:func:`kvfast.check.hf.first_acting_step`) is
  counted as a wrong step.

Prints Markdown tables (pasted into docs/check.md).

``--padded`` measures instead whether a left-padded recompute (:class:`PaddedVariant`)
would add to control mode's floor: over the same clean and bugged runs, control mode
with the built-in variants against the same plus the padded recompute.
"""

from __future__ import annotations

import argparse
import copy
import itertools

import numpy as np
import pandas as pd

from kvfast.check.checker import check_cache
from kvfast.check.hf import (
    ATTENTION,
    DTYPES,
    FAMILIES,
    HF_BUGS,
    TINY_VOCAB,
    HFModel,
    first_acting_step,
    tiny_model,
)


def cases(seeds: int, prompts: int, steps: int):
    """``(seed, prompt_id, prompt, continuation)``: deterministic from the arguments."""
    for seed in range(seeds):
        rng = np.random.default_rng(1000 + seed)
        for k in range(prompts):
            prompt = rng.integers(0, TINY_VOCAB, 4 + (k % 4))
            yield seed, k, prompt, rng.integers(0, TINY_VOCAB, steps)


def first_step(report, bug: str) -> tuple[int | None, bool]:
    """The earliest first bug step over the scenarios, and whether it is where the bug first acts."""
    T = report.prompt.shape[0]
    got, right = None, True
    for name, s in report.scenarios.items():
        want = first_acting_step(bug, name, T)
        if s.first_bug_step is not None and (got is None or s.first_bug_step < got):
            got = s.first_bug_step
        if want is not None and s.verdict == "bug" and s.first_bug_step != want:
            right = False
    return got, right


def measure(seeds: int = 3, prompts: int = 3, steps: int = 24, families=FAMILIES, dtypes=DTYPES) -> pd.DataFrame:
    """One row per run: model, case, bug (``None``: clean), native verdict and ratio, logic-check verdict."""
    import torch

    torch.set_num_threads(1)
    rows = []
    for family, dtype, attention in itertools.product(families, dtypes, ATTENTION):
        for seed, k, prompt, continuation in cases(seeds, prompts, steps):
            model = tiny_model(family, dtype, attention, seed)
            base = dict(family=family, dtype=dtype, attention=attention, seed=seed, prompt=k)
            if k == 0:
                greedy = check_cache(model, prompt, steps, mode="control")
                rows.append({**base, "bug": None, "feed": "greedy", "verdict": greedy.verdict,
                             "ratio": greedy.max_ratio})  # fmt: skip
            clean = check_cache(model, prompt, mode="control", continuation=continuation)
            rows.append({**base, "bug": None, "feed": "given", "verdict": clean.verdict, "ratio": clean.max_ratio})
            for bug in HF_BUGS:
                report = check_cache(
                    HFModel(model, bug=bug), prompt, mode="control", continuation=continuation, promote="float64"
                )
                step, right = first_step(report, bug)
                lstep, lright = first_step(report.promoted, bug)
                rows.append({
                    **base, "bug": bug, "feed": "given", "verdict": report.verdict, "ratio": report.max_ratio,
                    "step": step, "right_step": right, "logic_verdict": report.promoted.verdict,
                    "logic_ratio": report.promoted.max_ratio, "logic_step": lstep, "logic_right_step": lright,
                })  # fmt: skip
    return pd.DataFrame(rows)


def tables(df: pd.DataFrame) -> str:
    """The clean table (false positives) and the bug table (misses), as Markdown."""
    out = []
    clean = df[df["bug"].isna()]
    out.append("| clean runs | dtype | runs | bug (false positive) | inconclusive | largest ratio |")
    out.append("|---|---|---|---|---|---|")
    for dtype, g in clean.groupby("dtype", sort=False):
        out.append(
            f"| all families, sdpa+eager | {dtype} | {len(g)} | {(g.verdict == 'bug').sum()} "
            f"| {(g.verdict == 'inconclusive').sum()} | {g.ratio.max():.3g} |"
        )
    out.append(
        f"| **all** | | {len(clean)} | {(clean.verdict == 'bug').sum()} "
        f"(rate {(clean.verdict == 'bug').mean():.3f}) | {(clean.verdict == 'inconclusive').sum()} "
        f"| {clean.ratio.max():.3g} |"
    )
    bugs = df[df["bug"].notna()]
    out.append("")
    out.append(
        "| bug | dtype | runs | native: bug / inconclusive / rounding | native at the right step "
        "| logic check (float64): bug | at the right step | smallest logic ratio |"
    )
    out.append("|---|---|---|---|---|---|---|---|")
    for (bug, dtype), g in bugs.groupby(["bug", "dtype"], sort=False):
        v = g.verdict
        caught = g[v == "bug"]
        lc = g[g.logic_verdict == "bug"]
        out.append(
            f"| {bug} | {dtype} | {len(g)} | {(v == 'bug').sum()} / {(v == 'inconclusive').sum()} / "
            f"{(v == 'rounding').sum()} | {caught.right_step.sum()} of {len(caught)} | {len(lc)} "
            f"| {lc.logic_right_step.sum()} of {len(lc)} | {g.logic_ratio.min():.3g} |"
        )
    logic = bugs[bugs.bug != "f16"]
    for name, sel in (("logic bugs, float32/float64 native", logic[logic.dtype != "bfloat16"]),
                      ("logic bugs, bfloat16 native", logic[logic.dtype == "bfloat16"]),
                      ("all bugs, logic check in float64", bugs)):  # fmt: skip
        col = "logic_verdict" if "logic check" in name else "verdict"
        miss = (sel[col] != "bug").mean()
        out.append(f"\nmiss rate, {name}: {miss:.3f} ({(sel[col] != 'bug').sum()} of {len(sel)})")
    return "\n".join(out)


PAD = 3


class PaddedVariant(HFModel):
    """:class:`HFModel` whose variants also include ``"padded"``: the sequence after ``PAD`` pad tokens that the
    attention mask hides, positions from 0 at the first real token, on a deep copy (measured, not kept)."""

    def recompute_variants(self, tokens) -> dict:
        import torch

        out = super().recompute_variants(tokens)
        ids = self._ids(tokens, 0)
        pad = torch.zeros(1, PAD, dtype=torch.long)
        mask = torch.cat([pad, torch.ones_like(ids)], 1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        if "padded" not in self._copies:
            self._copies["padded"] = copy.deepcopy(self.model).eval()
        kwargs = {"attention_mask": mask, "position_ids": positions, "use_cache": False}
        logits, _ = self._call(self._copies["padded"], input_ids=torch.cat([pad, ids], 1), **kwargs)
        out["padded"] = logits[0, PAD:]
        return out


def padded_effect(seeds: int = 3, prompts: int = 3, steps: int = 24) -> str:
    """What the padded recompute changes in control mode over the matrix (clean and bugged runs), as text."""
    import torch

    torch.set_num_threads(1)
    clean, nan, raised, factor, before, after, bugged, changed = 0, 0, 0, 1.0, 0.0, 0.0, 0, []
    for family, dtype, attention in itertools.product(FAMILIES, DTYPES, ATTENTION):
        for seed, k, prompt, continuation in cases(seeds, prompts, steps):
            model = tiny_model(family, dtype, attention, seed)
            for bug in (None, *HF_BUGS):
                base = check_cache(HFModel(model, bug=bug), prompt, mode="control", continuation=continuation)
                try:
                    pad = check_cache(PaddedVariant(model, bug=bug), prompt, mode="control", continuation=continuation)
                except ValueError as exc:  # NaN logits: fully masked pad rows (float64 eager)
                    if "logits hold nan" not in str(exc):
                        raise
                    nan += bug is None
                    continue
                if bug is None:
                    clean += 1
                    before, after = max(before, base.max_ratio), max(after, pad.max_ratio)
                    if pad.max_ratio < base.max_ratio:
                        raised += 1
                        factor = max(factor, base.max_ratio / pad.max_ratio)
                else:
                    bugged += 1
                    if pad.verdict != base.verdict:
                        changed.append(f"{family} {dtype} {attention} seed {seed} prompt {k} {bug}: "
                                       f"{base.verdict} -> {pad.verdict}")  # fmt: skip
    lines = [
        f"clean runs: {clean} (and {nan} where the padded recompute returns NaN logits)",
        f"clean runs whose floor the padded recompute raises: {raised} (by up to {factor:.3g}x)",
        f"largest clean ratio: {before:.3g} without, {after:.3g} with the padded recompute",
        f"bugged runs: {bugged}; verdicts the padded recompute changes: {len(changed)}",
    ]
    return "\n".join(lines + changed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--padded", action="store_true", help="measure what a left-padded recompute would add")
    args = ap.parse_args(argv)
    command = f"python -m kvfast.check.hf_matrix --seeds {args.seeds} --prompts {args.prompts} --steps {args.steps}"
    if args.padded:
        print(f"{command} --padded\n")
        print(padded_effect(args.seeds, args.prompts, args.steps))
        return 0
    df = measure(args.seeds, args.prompts, args.steps)
    print(f"{command}\n")
    print(tables(df))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
