"""Benchmark and verdict table: kvfast's checks on inference engines (tiny random Llamas built here).

    .venv/bin/python benchmarks/engines.py [--steps 64] [--seeds 2] [--repeats 5] [--precisions fp32,int8] [--out DIR]
        [--sweep-seeds N] [--sweep-prompts 5]

For onnxruntime-genai (``kvfast[ort]``), seeds ``0..seeds-1`` build a tiny random
Llama and convert it (:func:`kvfast.testing.tiny_ort_model`) at each of ``precisions`` (the
builder's ``-p``), then:

- **verdicts**, per build: clean runs in control mode over the seeds x two prompts x ``steps`` decode steps,
  both scenarios, with the engine's own variants only and with the cross-implementation variant (the same
  weights recomputed in transformers; for an int8 build the build's weights dequantized, with its int8
  activations), and each injected bug of the engine's catalogue (its first bug step against the step where it
  first acts); the largest clean ratio and the smallest bug ratio;
- **the engine's own noise sweep** (``--sweep-seeds N``, off by default): fp32 builds of seeds ``0..N-1``,
  ``--sweep-prompts`` random prompts each (2 to 39 tokens), ``steps`` steps, the decode, resume and rollback
  scenarios with the engine's own variants only (no outside weights): the clean verdicts and each injected
  bug's verdict where it first acts;
- **cost** (the first precision's build): the median CPU time of the control check (decode; decode + resume)
  against a plain cached generation through the engine (prefill, then one token per step), as ratios measured
  in this run.

For llama.cpp (``kvfast[llamacpp]``, when installed): the same cost ratios, float16 and float32 KV cache. The
verdicts of every engine on the same weights: ``kvfast run engines_all`` (the ``engines`` study).

Prints Markdown tables (pasted into docs/engines.md).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

PROMPTS = ([3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1])


def median_cpu(fn, repeats: int) -> float:
    """Median CPU time of ``repeats`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        c0 = time.process_time()
        fn()
        times.append(time.process_time() - c0)
    return statistics.median(times)


def largest_relative_deviation(model, report) -> float:
    """The largest deviation of any scenario's step over the largest logit of its reference rows (the model's
    recompute of the prompt and the fed tokens: step 0 is the prompt's rows, step ``t`` the row at
    ``len(prompt) + t - 1``)."""
    scale = np.abs(model.recompute(np.concatenate([report.prompt, report.tokens]))).max(-1)
    n = len(report.prompt)
    per_step = np.concatenate([[scale[:n].max()], scale[n:]])
    return max(float(np.max(s.deviation / per_step[: len(s.deviation)])) for s in report.scenarios.values())


def ort_verdicts(builds: dict[str, list[tuple[Path, Path]]], steps: int) -> None:
    from kvfast.bugs.engine_bugs import ORT_BUGS, inject_ort_bug
    from kvfast.check import check_cache
    from kvfast.check.engines.ort import DEFAULT_VARIANTS, ORTModel

    seeds = len(next(iter(builds.values())))
    print(f"\n### onnxruntime-genai: verdicts ({seeds} seeds x {len(PROMPTS)} prompts x {steps} steps, control)")
    print("| build | internal formats | variants | runs | rounding | inconclusive | bug | largest ratio | "
          "largest relative deviation |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    own, cross = DEFAULT_VARIANTS, (*DEFAULT_VARIANTS, "transformers")
    rows = [("engine's own without chunk (batch, no-opt)", ("batch", "no-opt"), True),
            (f"engine's own ({', '.join(own)})", own, True), ("+ transformers (cross-implementation)", cross, True),
            ("+ transformers, internal formats undeclared beyond kv cache and compute", cross, False)]  # fmt: skip
    for (precision, built), (label, variants, declared) in itertools.product(builds.items(), rows):
        counts = {"rounding": 0, "inconclusive": 0, "bug": 0}
        largest = relative = 0.0
        formats = ORTModel(built[0][0]).internal_formats
        if not declared and set(formats) <= {"kv cache", "compute"}:
            continue  # nothing declared beyond them: the row above
        for onnx, hf in built:
            model = ORTModel(onnx, variants=variants, hf_model=hf if "transformers" in variants else None)
            if not declared:  # what the check says without the int8 activations: float32 is all it knows
                model.internal_formats = {k: v for k, v in formats.items() if k in ("kv cache", "compute")}
            for prompt in PROMPTS:
                report = check_cache(model, prompt, steps, mode="control")
                relative = max(relative, largest_relative_deviation(model, report))
                for scenario in report.scenarios.values():
                    counts[scenario.verdict] += 1
                    largest = max(largest, float(np.max(scenario.bounds.ratio)))
        runs = sum(counts.values())
        shown = ", ".join(f"{k} {v}" for k, v in model.internal_formats.items())
        print(
            f"| {precision} | {shown} | {label} | {runs} | {counts['rounding']} | {counts['inconclusive']} | "
            f"{counts['bug']} | {largest:.3g} | {relative:.3g} |"
        )
    print(
        "\n| build | injected bug | scenario | variants | runs | bug at the step it first acts | smallest bug ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    scenario_of = {"evict": "decode", "rewind": "rollback"}  # where each first acts (ORT_BUGS' first_acting_step)
    sets = {"engine's own": own, "+ transformers": cross}
    for (precision, built), bug, (label, variants) in itertools.product(builds.items(), ORT_BUGS, sets.items()):
        hits, runs, smallest, scenario = 0, 0, np.inf, scenario_of[bug]
        for onnx, hf in built:
            model = ORTModel(onnx, variants=variants, hf_model=hf if "transformers" in variants else None)
            inject_ort_bug(model, bug)
            for prompt in PROMPTS:
                report = check_cache(model, prompt, steps, mode="control", scenarios=(scenario,))
                found = report.scenarios[scenario]
                acts = ORT_BUGS[bug].first_acting_step(scenario, len(prompt))
                runs += 1
                hits += found.first_bug_step == acts
                smallest = min(smallest, float(found.bounds.ratio[acts]))
        print(f"| {precision} | {bug} | {scenario} | {label} | {runs} | {hits} of {runs} | {smallest:.3g} |")


def ort_own_sweep(root: Path, seeds: int, prompts: int, steps: int) -> None:
    from kvfast.bugs.engine_bugs import ORT_BUGS, inject_ort_bug
    from kvfast.check import check_cache
    from kvfast.check.engines.ort import ORTModel
    from kvfast.testing import tiny_ort_model

    scenarios = ("decode", "resume", "rollback")
    clean: dict[str, int] = {}
    bugs: dict[str, dict[str, int]] = {name: {} for name in ORT_BUGS}
    largest, smallest = 0.0, {name: np.inf for name in ORT_BUGS}
    for seed in range(seeds):
        out = root / f"fp32-seed{seed}"
        onnx = out / "onnx" if (out / "onnx" / "genai_config.json").is_file() else tiny_ort_model(out, seed=seed)
        model, rng = ORTModel(onnx), np.random.default_rng(seed)
        for _ in range(prompts):
            prompt = rng.integers(3, model.vocab_size, int(rng.integers(2, 40)))
            for found in check_cache(model, prompt, steps, mode="control", scenarios=scenarios).scenarios.values():
                clean[found.verdict] = clean.get(found.verdict, 0) + 1
                largest = max(largest, float(np.max(found.bounds.ratio)))
            for name, bug in ORT_BUGS.items():
                acting = {s: bug.first_acting_step(s, len(prompt)) for s in scenarios}
                acting = {s: step for s, step in acting.items() if step is not None}
                report = check_cache(inject_ort_bug(ORTModel(onnx), name), prompt, steps, "control", tuple(acting))
                for s, found in report.scenarios.items():
                    key = f"{found.verdict}{' at its first acting step' if found.first_bug_step == acting[s] else ''}"
                    bugs[name][key] = bugs[name].get(key, 0) + 1
                    smallest[name] = min(smallest[name], float(found.bounds.ratio[acting[s]]))
    print(f"\n### onnxruntime-genai fp32, the engine's own variants only ({seeds} seeds x {prompts} random prompts x "
          f"{steps} steps; {', '.join(scenarios)})")  # fmt: skip
    print("| model | scenario runs | verdicts | largest clean ratio / smallest bug ratio |")
    print("|---|---|---|---|")
    shown = ", ".join(f"{k} {v}" for k, v in sorted(clean.items()))
    print(f"| clean | {sum(clean.values())} | {shown} | {largest:.3g} |")
    for name, counts in bugs.items():
        shown = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        print(f"| {name} | {sum(counts.values())} | {shown} | {smallest[name]:.3g} |")


def ort_cost(onnx: Path, hf: Path, steps: int, repeats: int, precision: str) -> None:
    import onnxruntime_genai as og

    from kvfast.check import check_cache
    from kvfast.check.engines.ort import ORTModel

    model = ORTModel(onnx, variants=("batch", "transformers"), hf_model=hf)
    own = ORTModel(onnx)  # the engine's own variants (no outside weights)
    prompt = np.array(PROMPTS[1])

    def plain() -> None:
        params = og.GeneratorParams(model.og_model)
        params.set_search_options(max_length=model.max_positions)
        gen = og.Generator(model.og_model, params)
        gen.append_tokens(prompt.astype(np.int32)[None, :])
        for _ in range(steps):
            token = int(np.argmax(gen.get_output("logits")[0, -1]))
            gen.append_tokens(np.array([[token]], dtype=np.int32))

    base = median_cpu(plain, repeats)
    decode = median_cpu(lambda: check_cache(model, prompt, steps, "control", "decode"), repeats)
    both = median_cpu(lambda: check_cache(model, prompt, steps, "control"), repeats)
    alone = median_cpu(lambda: check_cache(own, prompt, steps, "control"), repeats)
    print(
        f"\n### onnxruntime-genai: cost ({precision} build, {steps} decode steps, {len(prompt)}-token prompt, "
        f"median of {repeats})"
    )
    print("| what | CPU s | x plain |")
    print("|---|---|---|")
    mine = f"control check (decode + resume; engine's own: {', '.join(own.variants)})"
    for name, value in (("plain cached generation", base), ("control check (decode; batch, transformers)", decode),
                        ("control check (decode + resume; batch, transformers)", both), (mine, alone)):  # fmt: skip
        print(f"| {name} | {value:.4f} | {value / base:.2f} |")


def llamacpp_cost(out: Path, steps: int, repeats: int) -> None:
    from kvfast.check import check_cache
    from kvfast.check.engines.llamacpp import LlamaCppModel
    from kvfast.testing import tiny_gguf_model

    gguf = tiny_gguf_model(out, seed=0, weights="f32")
    prompt = np.array(PROMPTS[1])
    print(f"\n### llama.cpp: cost ({steps} decode steps, {len(prompt)}-token prompt, f32 weights, median of {repeats})")
    print("| KV cache | what | CPU s | x plain |")
    print("|---|---|---|---|")
    for cache in ("f16", "f32"):
        model = LlamaCppModel(gguf, cache=cache, hf_model=out / "hf")
        llm = model._context()

        def plain(llm=llm) -> None:
            llm.reset()
            llm.eval([int(t) for t in prompt])
            for _ in range(steps):
                llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])

        base = median_cpu(plain, repeats)
        decode = median_cpu(lambda m=model: check_cache(m, prompt, steps, "control", "decode"), repeats)
        both = median_cpu(lambda m=model: check_cache(m, prompt, steps, "control"), repeats)
        for name, value in (("plain cached generation", base), ("control check (decode)", decode),
                            ("control check (decode + resume)", both)):  # fmt: skip
            print(f"| {cache} | {name} | {value:.4f} | {value / base:.2f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--precisions", default="fp32,int8", help="onnxruntime-genai builds, comma-separated")
    ap.add_argument("--out", default=None, help="where to build the tiny models (default: a temporary folder)")
    ap.add_argument("--sweep-seeds", type=int, default=0, help="the engine's own noise sweep over this many seeds")
    ap.add_argument("--sweep-prompts", type=int, default=5, help="random prompts per seed in that sweep")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.seeds < 1 or args.repeats < 1 or args.sweep_seeds < 0 or args.sweep_prompts < 1:
        ap.error("--steps, --seeds, --repeats and --sweep-prompts must be >= 1, --sweep-seeds >= 0")
    try:
        import onnxruntime_genai  # noqa: F401
        import torch

        from kvfast.testing import PRECISIONS, tiny_ort_model
    except ImportError:
        print("onnxruntime-genai not installed (pip install 'kvfast[ort,hf]'): nothing to measure")
        return 0
    precisions = args.precisions.split(",")
    if not precisions or any(p not in PRECISIONS for p in precisions):
        ap.error(f"--precisions: {args.precisions!r} is not allowed; allowed: a comma-separated subset of {PRECISIONS}")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        builds = {
            p: [(tiny_ort_model(root / f"{p}-seed{s}", seed=s, precision=p), root / f"{p}-seed{s}" / "hf")
                for s in range(args.seeds)]
            for p in precisions
        }  # fmt: skip
        ort_verdicts(builds, args.steps)
        if args.sweep_seeds:
            ort_own_sweep(root, args.sweep_seeds, args.sweep_prompts, args.steps)
        ort_cost(*builds[precisions[0]][0], args.steps, args.repeats, precisions[0])
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("\nllama.cpp: llama-cpp-python not installed (pip install 'kvfast[llamacpp]'): not measured")
        else:
            llamacpp_cost(root / "gguf", args.steps, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
