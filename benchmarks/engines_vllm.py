"""Cost and verdict tables of kvfast's checks on vLLM (a tiny random Llama built here; vLLM's own venv).

    .venv-vllm/bin/python benchmarks/engines_vllm.py [--steps 32] [--repeats 5] [--prompt-len 70] [--dtype float32]
        [--only cost,bugs,batch,variants,long]

One engine (:class:`kvfast.check.engines.vllm.VLLMModel`, ``--dtype``; the tiny model with as many positions as
the check needs), then, in this run (``--only``: some; ``long`` only when asked):

- **cost**: the median wall time of a check (the default mode, exact mode and control mode, both scenarios; vLLM as
  it serves: its threads, split-KV) against a
  plain vLLM generation of the same tokens (one fresh request: its own prefix-cache salt, so no repeat reads the
  cache an earlier one left; ``steps`` greedy tokens, no logprobs), and the ratios; where exact mode runs the GEMMs
  as vLLM does (the row-count probe finds nothing on this CPU), also an exact check with them pinned to one row
  (``gemm_rows=1``: what exact mode runs by default on a CPU whose GEMMs change with the row count);
- **bugs**: each bug of :data:`kvfast.bugs.engine_bugs.VLLM_BUGS` in exact mode (its first divergent step per
  scenario against the step where it first acts) and in control mode (the verdict);
- **batch invariance**: the prompt's ``steps`` decoded rows when it decodes together with other requests (1 to 7
  others, same length) against the same rows when it decodes alone (vLLM's greedy decode, full-vocabulary rows);
- **variants**: control mode's verdict and largest ratio with every variant (:data:`VARIANTS`) and with the
  ``chunk`` (:data:`CHUNKS`) left out, on the clean engine and each catalogue bug, over three prompts, and each
  variant's largest measured noise (relative to the row's largest logit): what dropping a variant changes;
- **long**: an exact and a control check's verdicts, first differing steps and sizes, and notes (with
  ``--prompt-len 3500``: the long-context findings of docs/engines.md).

Prints Markdown tables (pasted into docs/engines.md).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=70)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--only", default=",".join(SECTIONS[:4]), help=f"comma-separated sections of {SECTIONS}")
    args = parser.parse_args()
    only = [s.strip() for s in args.only.split(",")]
    if not set(only) <= set(SECTIONS):
        parser.error(f"--only: {args.only!r} is not allowed; allowed: sections of {SECTIONS}")

    from kvfast.check.engines.vllm import VLLMModel
    from kvfast.testing import tiny_vllm_model

    prompt = [3 + i % 250 for i in range(args.prompt_len)]
    with tempfile.TemporaryDirectory() as out:
        positions = max(256, args.prompt_len + args.steps + 1)  # the tiny model's 256, or as many as a check needs
        engine = VLLMModel(tiny_vllm_model(out, seed=1, positions=positions), dtype=args.dtype)
        for section in only:
            run = {"cost": cost, "bugs": bugs, "batch": batch_invariance, "variants": variants, "long": reports}
            run[section](engine, prompt, args)
            print()


SECTIONS = ("cost", "bugs", "batch", "variants", "long")


def cost(engine, prompt: list[int], args) -> None:
    """Print the cost table (see the module doc)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvfast.check import check_cache
    from kvfast.check.engines.vllm import VLLMModel

    plain = SamplingParams(max_tokens=args.steps, temperature=0.0, detokenize=False, ignore_eos=True)
    salts = iter(range(10**9))

    def generate() -> None:  # a fresh request: a salt of its own, so no repeat hits an earlier one's blocks
        request = TokensPrompt(prompt_token_ids=prompt, cache_salt=f"plain-{next(salts)}")
        engine.llm.generate([request], plain, use_tqdm=False)

    runs = {
        "plain generation": generate,
        "check, auto (the default)": lambda: check_cache(engine, prompt, args.steps),
        "check, exact": lambda: check_cache(engine, prompt, args.steps, mode="exact"),
        "check, control": lambda: check_cache(engine, prompt, args.steps, mode="control"),
    }
    if _pinned(engine, prompt) == "as vLLM runs them":  # what exact mode costs where the probe pins the GEMMs
        pinned = VLLMModel(engine.llm, gemm_rows=1)
        runs["check, exact, gemm_rows=1"] = lambda: check_cache(pinned, prompt, args.steps, mode="exact")
    for run in runs.values():  # warm-up
        run()
    times = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["plain generation"])
    print(f"| run ({args.dtype}, {args.steps} steps, prompt {len(prompt)}) | median s | x plain generation |")
    print("|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.3f} | {statistics.median(ts) / base:.1f} |")
    print()
    print(f"{engine!r}: exact mode's GEMMs {_pinned(engine, prompt)}; variants {engine.variants}")


def _pinned(engine, prompt: list[int]) -> str:
    """How an exact check ran vLLM's GEMMs (the adapter's ``gemm_rows`` resolved by ``prepare_check``)."""
    import numpy as np

    from kvfast.check.engines.vllm import VLLMModel
    from kvfast.check.protocol import CheckPlan

    probe = VLLMModel(engine.llm)
    probe.prepare_check(CheckPlan(np.asarray(prompt, dtype=np.int64), len(prompt) // 2, 1, ("decode",), False))
    return "as vLLM runs them" if probe.rows_pinned is None else f"{probe.rows_pinned} row(s) at a time"


def bugs(engine, prompt: list[int], args) -> None:
    """Print the bug table (see the module doc)."""
    from kvfast.bugs.engine_bugs import VLLM_BUGS, first_acting_step, inject_vllm_bug
    from kvfast.check import check_cache
    from kvfast.check.engines.vllm import VLLMModel

    print(f"exact mode: VLLMModel() (its GEMMs {_pinned(engine, prompt)}); control mode: VLLMModel() ({args.dtype})")
    print()
    print("| bug | scenario | first acting step | first divergent step (exact) | control verdict |")
    print("|---|---|---|---|---|")
    for name in VLLM_BUGS:
        exact = check_cache(inject_vllm_bug(VLLMModel(engine.llm), name), prompt, args.steps, fast=False)
        control = check_cache(inject_vllm_bug(VLLMModel(engine.llm), name), prompt, args.steps, mode="control")
        for scenario, report in exact.scenarios.items():
            acts = first_acting_step(name, scenario, len(prompt))
            print(f"| {name} | {scenario} | {acts} | {report.first_divergent_step} | {control.verdict} |")


def variants(engine, prompt: list[int], args) -> None:
    """Print the variants table (see the module doc)."""
    import numpy as np

    from kvfast.bugs.engine_bugs import VLLM_BUGS, inject_vllm_bug
    from kvfast.check import check_cache
    from kvfast.check.engines.vllm import VARIANTS, VLLMModel

    without_chunk = tuple(v for v in VARIANTS if v != "chunk")

    prompts = {"prompt": prompt, "reversed": prompt[::-1], "strided": [3 + (7 * i) % 250 for i in range(len(prompt))]}
    every = VLLMModel(engine.llm, variants=VARIANTS)
    print(f"| case ({args.dtype}) | prompt | verdict, max ratio: {VARIANTS} | {without_chunk} | "
          + " | ".join(f"noise {v!r}" for v in VARIANTS) + " |")  # fmt: skip
    print("|---|---|---|---|" + "---|" * len(VARIANTS))
    for case in (None, *VLLM_BUGS):
        for label, tokens in prompts.items():
            cells = []
            for names in (VARIANTS, without_chunk):
                model = VLLMModel(engine.llm, variants=names)
                model = model if case is None else inject_vllm_bug(model, case)
                report = check_cache(model, tokens, args.steps, mode="control")
                ratio = max(float(np.nanmax(r.bounds.ratio)) for r in report.scenarios.values())
                cells.append(f"{report.verdict}, {ratio:.3g}")
            final = np.concatenate([tokens, report.tokens])
            ref = engine.recompute(final)
            scale = np.abs(ref).max(axis=1)
            noise = {
                k: float((np.abs(v - ref).max(axis=1) / scale).max())
                for k, v in every.recompute_variants(final).items()
            }
            print(f"| {case or 'clean'} | {label} | {cells[0]} | {cells[1]} | "
                  + " | ".join(f"{noise[v]:.3g}" if v in noise else "skipped" for v in VARIANTS) + " |")  # fmt: skip


def reports(engine, prompt: list[int], args) -> None:
    """Print an exact and a control check's verdicts, where each scenario first fails and by how much, and their
    notes (``--only long --prompt-len 3500``: what a long prompt shows; see the module doc)."""
    from kvfast.check import check_cache

    for mode in ("exact", "control"):
        report = check_cache(engine, prompt, args.steps, mode=mode)
        print(f"- {mode} ({args.dtype}, prompt {len(prompt)}, {args.steps} steps): {report.verdict}")
        for name, scenario in report.scenarios.items():
            step = scenario.first_divergent_step
            size = "" if step is None else f", by {scenario.deviation[step]:.3g}"
            print(f"  - {name}: {scenario.verdict}, first differing step {step}{size}")
        for note in report.notes:
            print(f"  - note: {note}")


def batch_invariance(engine, prompt: list[int], args) -> None:
    """Print the batch-invariance table (see the module doc)."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    steps = args.steps
    params = SamplingParams(
        max_tokens=steps, temperature=0.0, detokenize=False, ignore_eos=True, logprobs=-1, flat_logprobs=True
    )

    def decoded_rows(others: int) -> np.ndarray:
        prompts = [prompt] + [[3 + (t * (k + 2)) % 250 for t in prompt] for k in range(others)]
        salted = [TokensPrompt(prompt_token_ids=p, cache_salt=f"batch-{others}-{i}") for i, p in enumerate(prompts)]
        out = engine.llm.generate(salted, params, use_tqdm=False)[0].outputs[0]
        return engine._flat_rows(out.logprobs, range(len(out.token_ids)))

    alone = decoded_rows(0)
    print("| requests decoding together | max abs(row - row alone) | first differing step |")
    print("|---|---|---|")
    for others in (1, 3, 4, 7):
        dev = np.abs(decoded_rows(others) - alone).max(axis=1)
        first = int(np.argmax(dev > 0)) if (dev > 0).any() else None
        print(f"| {others + 1} | {float(dev.max()):.6g} | {first} |")


if __name__ == "__main__":
    main()
