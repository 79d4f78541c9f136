"""Cost and verdict table of kvfast's checks on vLLM (a tiny random Llama built here; vLLM's own venv).

    .venv-vllm/bin/python benchmarks/engines_vllm.py [--steps 32] [--repeats 5] [--prompt-len 70] [--dtype float32]

One engine (:class:`kvfast.check.engines.vllm.VLLMModel`, ``--dtype``), then, in this run:

- **cost**: the median wall time of a check (exact mode, both scenarios; control mode, both scenarios) against a
  plain vLLM generation of the same tokens (one request, ``steps`` greedy tokens, no logprobs), and the ratios;
- **verdicts**: each bug of :data:`kvfast.bugs.engines.VLLM_BUGS` in exact mode (its first divergent step per
  scenario against the step where it first acts) and in control mode (the verdict);
- **batch invariance**: the prompt's ``steps`` decoded rows when it decodes together with other requests (1 to 7
  others, same length) against the same rows when it decodes alone (vLLM's greedy decode, full-vocabulary rows).

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
    args = parser.parse_args()

    from kvfast.bugs.engines import VLLM_BUGS, first_acting_step, inject_vllm_bug
    from kvfast.check import check_cache
    from kvfast.check.engines.vllm import VLLMModel, tiny_vllm_model

    prompt = [3 + i % 250 for i in range(args.prompt_len)]
    with tempfile.TemporaryDirectory() as out:
        engine = VLLMModel(tiny_vllm_model(out, seed=1), dtype=args.dtype)
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        plain = SamplingParams(max_tokens=args.steps, temperature=0.0, detokenize=False, ignore_eos=True)

        def generate() -> None:
            engine.llm.generate([TokensPrompt(prompt_token_ids=prompt)], plain, use_tqdm=False)

        runs = {
            "plain generation": generate,
            "check, exact": lambda: check_cache(engine, prompt, args.steps, mode="exact"),
            "check, control": lambda: check_cache(engine, prompt, args.steps, mode="control"),
        }
        for run in runs.values():  # warm-up
            run()
        times = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        base = statistics.median(times["plain generation"])
        print(f"| run ({args.dtype}, {args.steps} steps, prompt {args.prompt_len}) | median s | x plain generation |")
        print("|---|---|---|")
        for name, ts in times.items():
            print(f"| {name} | {statistics.median(ts):.3f} | {statistics.median(ts) / base:.1f} |")
        print()
        rows = 1 if args.dtype == "bfloat16" else None  # exact mode in bfloat16: decode-shaped GEMMs on both paths
        print(f"exact mode: VLLMModel(gemm_rows={rows}); control mode: VLLMModel() ({args.dtype})")
        print()
        print("| bug | scenario | first acting step | first divergent step (exact) | control verdict |")
        print("|---|---|---|---|---|")
        for name in VLLM_BUGS:
            exact = check_cache(
                inject_vllm_bug(VLLMModel(engine.llm, gemm_rows=rows), name), prompt, args.steps, fast=False
            )
            control = check_cache(inject_vllm_bug(VLLMModel(engine.llm), name), prompt, args.steps, mode="control")
            for scenario, report in exact.scenarios.items():
                acts = first_acting_step(name, scenario, len(prompt))
                print(f"| {name} | {scenario} | {acts} | {report.first_divergent_step} | {control.verdict} |")
        print()
        batch_invariance(engine, prompt, args.steps)


def batch_invariance(engine, prompt: list[int], steps: int) -> None:
    """Print the batch-invariance table (see the module doc)."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

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
