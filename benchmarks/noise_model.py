"""The noise model measured: the formats computed inside a model, the floor they set under the order-noise bound,
the admission ceiling and the rounding probe, on correct models and on cache bugs (docs/check.md, section 3 "How a
step is judged against order noise"; the tables: benchmarks/README.md, "The noise model: internal formats, the
rounding probe").

    .venv/bin/python benchmarks/noise_model.py [--seeds 2]

For tiny random Hugging Face models (Llama sdpa/eager, Bloom eager; float32, float64, bfloat16) and kvfast's
own low-format test models (tests/toymodels.py: a float16 KV cache, int8 activations), prints:

1. the internal formats kvfast measures, the floor they set and the largest ratio over the clean runs
   (``--seeds`` seeds x 2 prompts, a given continuation of 12 tokens, control mode, both scenarios);
2. the order-noise sources refused by the admission ceiling, with their size against it;
3. each HF cache bug's native verdict and, from bfloat16, the float64 logic check's, with the smallest ratio;
4. float64 eager Llama and Bloom with and without the rounding probe (clean, f16, freeze);
5. the low-format toy models, clean and with a position off by one, with and without their declaration.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def bloom(dtype: str, seed: int):
    import torch
    import transformers

    config = transformers.BloomConfig(vocab_size=96, hidden_size=32, n_layer=2, n_head=4, attn_implementation="eager")
    torch.manual_seed(seed)
    return transformers.BloomForCausalLM(config).eval().to(getattr(torch, dtype))


def build(family: str, dtype: str, attention: str, seed: int):
    from kvfast.testing import tiny_model

    return bloom(dtype, seed) if family == "bloom" else tiny_model(family, dtype, attention, seed)


def runs(seeds: int):
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, 96, 8)) for _ in range(2)]
    for seed in range(seeds):
        for prompt in prompts:
            yield seed, prompt, list(np.random.default_rng(seed + 10).integers(1, 96, 12))


def clean_table(seeds: int) -> None:
    from kvfast.check import check_cache

    print("| model | dtype | attention | measured internal formats | floor | clean runs | verdicts | largest ratio |")
    print("|---|---|---|---|---|---|---|---|")
    refused: dict[str, float] = {}
    for family, attention in (("llama", "sdpa"), ("llama", "eager"), ("bloom", "eager")):
        for dtype in ("float32", "float64", "bfloat16"):
            verdicts, ratio, formats = {}, 0.0, None
            for seed, prompt, cont in runs(seeds):
                r = check_cache(build(family, dtype, attention, seed), prompt, mode="control", continuation=cont)
                verdicts[r.verdict] = verdicts.get(r.verdict, 0) + 1
                ratio, formats = max(ratio, r.max_ratio), r.formats
                for note in r.notes:
                    m = re.match(r"(variant '\w+'|batch shape[^(]*\(\d+ prefix recomputes\)) \(([\d.e+-]+) relative\) "
                                 r"not admitted.*?(\d+) ulps, ([\d.e+-]+) relative", note)  # fmt: skip
                    if m:
                        key = f"{family} {dtype} {attention}: {m.group(1)}"
                        refused[key] = max(refused.get(key, 0.0), float(m.group(2)) / float(m.group(4)))
            inside = ", ".join(f"{k} {v}" for k, v in sorted(formats.internal.items()))
            counts = ", ".join(f"{v} {k}" for k, v in sorted(verdicts.items()))
            n = sum(verdicts.values())
            print(f"| {family} | {dtype} | {attention} | {inside} | {formats.floor} | {n} | {counts} | {ratio:.3g} |")
    print("\nrefused order-noise sources (largest size / admission ceiling, over the clean runs):")
    for key, times in refused.items():
        print(f"- {key}: {times:.3g}x the ceiling")


def bug_table(seeds: int) -> None:
    from kvfast.bugs.hf import HF_BUGS, first_acting_step, inject_hf_bug
    from kvfast.check import check_cache
    from kvfast.check.hf import HFModel

    print("\n| model | bug | dtype | runs | verdicts | at the first acting step | smallest ratio |")
    print("|---|---|---|---|---|---|---|")
    for family, attention in (("llama", "eager"), ("bloom", "eager")):
        for bug in HF_BUGS:
            if family == "bloom" and bug in ("posoff", "restart"):  # Bloom's forward takes no position_ids
                continue
            for dtype in ("float32", "float64", "bfloat16"):
                verdicts, right, smallest, n = {}, 0, np.inf, 0
                for seed, prompt, cont in runs(seeds):
                    model = inject_hf_bug(HFModel(build(family, dtype, attention, seed)), bug)
                    promote = "float64" if dtype == "bfloat16" else None
                    r = check_cache(model, prompt, mode="control", continuation=cont, promote=promote)
                    judged = r.promoted if promote else r
                    n += 1
                    verdicts[judged.verdict] = verdicts.get(judged.verdict, 0) + 1
                    smallest = min(smallest, judged.max_ratio)
                    acting = {s: first_acting_step(bug, s, len(prompt)) for s in judged.scenarios}
                    right += all(
                        sc.first_bug_step == acting[name]
                        for name, sc in judged.scenarios.items()
                        if acting[name] is not None
                    )
                where = "logic check (float64)" if dtype == "bfloat16" else "native"
                counts = ", ".join(f"{v} {k}" for k, v in sorted(verdicts.items()))
                print(f"| {family} {attention} | {bug} | {dtype}, {where} | {n} | {counts} | {right} of {n} | "
                      f"{smallest:.3g} |")  # fmt: skip


def probe_table(seeds: int) -> None:
    from kvfast.bugs.hf import inject_hf_bug
    from kvfast.check import check_cache
    from kvfast.check.hf import HFModel

    print("\n| model | dtype | rounding probe | bug | runs | verdicts | largest ratio (clean) / smallest (bug) |")
    print("|---|---|---|---|---|---|---|")
    for family in ("llama", "bloom"):
        for probe in (True, False):
            for bug in (None, "f16", "freeze"):
                verdicts, ratios = {}, []
                for seed, prompt, cont in runs(seeds):
                    model = build(family, "float64", "eager", seed)
                    model = inject_hf_bug(HFModel(model) if probe else HFModel(model, variants=()), bug)
                    r = check_cache(model, prompt, mode="control", continuation=cont)
                    verdicts[r.verdict] = verdicts.get(r.verdict, 0) + 1
                    ratios.append(r.max_ratio)
                counts = ", ".join(f"{v} {k}" for k, v in sorted(verdicts.items()))
                shown = max(ratios) if bug is None else min(ratios)
                with_probe = "yes" if probe else "no (variants=())"
                print(f"| {family} eager | float64 | {with_probe} | {bug} | {len(ratios)} | {counts} | {shown:.3g} |")


def toy_table(seeds: int) -> None:
    from toymodels import LowFormatToy

    from kvfast.check import check_cache

    print("\n| toy model | declared | bug | runs | verdicts | largest ratio (clean) / smallest (bug) |")
    print("|---|---|---|---|---|---|")
    for kind in ("kv16", "int8"):
        for declare in (True, False):
            for bug in (None, "posoff"):
                verdicts, ratios = {}, []
                for seed in range(2 * seeds):
                    prompt = list(np.random.default_rng(seed).integers(0, 32, 8))
                    r = check_cache(LowFormatToy(kind, seed, bug, declare), prompt, 16, mode="control")
                    verdicts[r.verdict] = verdicts.get(r.verdict, 0) + 1
                    ratios.append(r.max_ratio)
                counts = ", ".join(f"{v} {k}" for k, v in sorted(verdicts.items()))
                shown = max(ratios) if bug is None else min(ratios)
                print(f"| {kind} | {declare} | {bug} | {len(ratios)} | {counts} | {shown:.3g} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    clean_table(args.seeds)
    bug_table(args.seeds)
    probe_table(args.seeds)
    toy_table(args.seeds)


if __name__ == "__main__":
    main()
