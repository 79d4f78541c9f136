"""Control mode's margin: the smallest bug ratio (at the step where the bug first acts) over the largest
clean ratio, per group of models, so a change to the bound can be seen not to let a bug through.

    .venv/bin/python benchmarks/control_margin.py [--runs 40] [--hf-prompts 2] [--no-hf]

Groups (every check in control mode):

- ``batched prefill``: ``examples/batched_prefill_model.py`` (plain protocol, no variants, no promote),
  float32 and bfloat16, ``--runs`` seeds x prompts, both scenarios, clean; the first ``--bug-runs`` of them
  also with each of its bugs (``BUGS``: ``posoff`` acts at step 1, ``freeze`` at step 2,
  ``extend_from_zero`` at the resume scenario's step 0);
- ``kvfast f32`` / ``kvfast bf16``: kvfast's own model with a prefill order and a decode order
  (``tests/check/test_check_control.py``'s setups), clean, and each catalogue bug (``kvfast.BUGS``) at the step
  where it first acts (from an exact check in one order);
- ``HF float32`` / ``HF float64``: the tiny Llama, GPT-2, Mistral and Qwen2 (sdpa), clean and with each
  ``kvfast.bugs.hf.HF_BUGS`` bug, natively; ``HF bfloat16 logic``: bfloat16 models, the float64 logic
  check's ratios. A bug's ratio is its ratio at ``kvfast.bugs.hf.first_acting_step`` in each scenario where
  it acts (the injected bugs of HF_BUGS act at a known step).

Prints one table row per group: runs, largest clean ratio, smallest bug ratio at its first step,
their quotient (the margin), and how many bugged runs were not ``bug`` at that step.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvfast import BUGS, ModelConfig, Numerics, init_params  # noqa: E402
from kvfast.check import KvfastModel, check_cache  # noqa: E402


def load_example():
    spec = importlib.util.spec_from_file_location(
        "batched_prefill_model", ROOT / "examples" / "batched_prefill_model.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Group:
    def __init__(self, name: str):
        self.name, self.clean, self.bugs, self.missed, self.runs = name, [], [], 0, 0

    def add_clean(self, report) -> None:
        self.runs += 1
        self.clean.append(max(float(s.bounds.ratio.max()) for s in report.scenarios.values() if s.bounds is not None))

    def add_bug(self, scenario, step: int) -> None:
        self.runs += 1
        self.bugs.append(float(scenario.bounds.ratio[step]))
        self.missed += scenario.step_verdicts[step] != "bug"

    def row(self) -> str:
        clean = max(self.clean) if self.clean else float("nan")
        bug = min(self.bugs) if self.bugs else float("nan")
        margin = (bug / clean if clean > 0 else float("inf")) if self.clean and self.bugs else float("nan")
        return f"| {self.name} | {self.runs} | {clean:.3g} | {bug:.3g} | {margin:.3g} | {self.missed} |"


BATCHED_FIRST_STEP = {"posoff": {"decode": 1, "resume": 1}, "freeze": {"decode": 2, "resume": 2},
                      "extend_from_zero": {"resume": 0}}  # fmt: skip


def batched_prefill(runs: int, bug_runs: int) -> list[Group]:
    example = load_example()
    groups = []
    for dtype in ("float32", "bfloat16"):
        g = Group(f"batched prefill {dtype}")
        for i, (seed, prompt, continuation) in enumerate(example.grid(runs)):
            model = example.BatchedPrefillModel(seed, dtype)
            g.add_clean(check_cache(model, prompt, continuation=continuation, mode="control"))
            for bug, first in BATCHED_FIRST_STEP.items() if i < bug_runs else ():
                model = example.BatchedPrefillModel(seed, dtype, bug=bug)
                report = check_cache(model, prompt, continuation=continuation, mode="control")
                for name, step in first.items():
                    g.add_bug(report.scenarios[name], step)
        groups.append(g)
    return groups


def kvfast_own() -> list[Group]:
    cfg = ModelConfig(vocab=32, d_model=32, n_head=4, n_layer=2, d_ff=64, max_pos=64)
    prompt, steps = [3, 1, 4, 1, 5, 9, 2], 20
    groups = []
    for name, (storage, accum) in {"f32": ("f32", "f32"), "bf16": ("bf16", "f32")}.items():
        g = Group(f"kvfast {name}")
        for seed in (1, 2):
            params = init_params(cfg, seed)
            pre, dec = Numerics(storage, accum, "pairwise"), Numerics(storage, accum, "sequential")
            g.add_clean(check_cache(KvfastModel(cfg, params, pre, decode_numerics=dec), prompt, steps, mode="control"))
            for bug in BUGS:
                acts = check_cache(KvfastModel(cfg, params, dec, bug=bug), prompt, steps, scenarios="decode")
                model = KvfastModel(cfg, params, pre, bug=bug, decode_numerics=dec)
                report = check_cache(model, prompt, steps, mode="control", scenarios="decode")
                g.add_bug(report.scenarios["decode"], acts.first_divergent_step)
        groups.append(g)
    return groups


def hugging_face(prompts: int) -> list[Group]:
    import torch

    from kvfast.bugs.hf import HF_BUGS, first_acting_step, inject_hf_bug
    from kvfast.check.hf import HFModel
    from kvfast.studies.hf_common import prompt_and_continuation
    from kvfast.studies.hf_matrix import PROMPT_LENGTHS, PROMPT_STREAM
    from kvfast.testing import FAMILIES, tiny_model

    torch.set_num_threads(1)
    groups = {k: Group(k) for k in ("HF float32", "HF float64", "HF bfloat16 logic")}
    for family in FAMILIES:
        for dtype, key in (("float32", "HF float32"), ("float64", "HF float64"), ("bfloat16", "HF bfloat16 logic")):
            model = tiny_model(family, dtype, "sdpa", 0)
            g = groups[key]
            for k in range(prompts):
                prompt, cont = prompt_and_continuation(PROMPT_STREAM, 0, k, 24, PROMPT_LENGTHS)
                kw = {"promote": "float64"} if dtype == "bfloat16" else {}
                for bug in (None, *HF_BUGS):
                    adapter = inject_hf_bug(HFModel(model), bug)
                    report = check_cache(adapter, prompt, continuation=cont, mode="control", **kw)
                    report = report.promoted if dtype == "bfloat16" else report
                    if bug is None:
                        g.add_clean(report)
                        continue
                    for name, s in report.scenarios.items():
                        step = first_acting_step(bug, name, len(prompt))
                        if step is not None:
                            g.add_bug(s, step)
    return list(groups.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40, help="batched-prefill runs per format")
    parser.add_argument("--bug-runs", type=int, default=40, help="batched-prefill runs with each of its bugs")
    parser.add_argument("--hf-prompts", type=int, default=2, help="prompts per Hugging Face model")
    parser.add_argument("--no-hf", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    groups = batched_prefill(args.runs, args.bug_runs) + kvfast_own()
    if not args.no_hf:
        groups += hugging_face(args.hf_prompts)
    print("| group | runs | largest clean ratio | smallest bug ratio at its first step | margin | not `bug` there |")
    print("|---|---|---|---|---|---|")
    for g in groups:
        print(g.row())


if __name__ == "__main__":
    main()
