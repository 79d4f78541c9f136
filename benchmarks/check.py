"""Benchmark: kvfast's every-step cache check against a plain cached generation.

    .venv/bin/python benchmarks/check.py [--steps 256] [--repeats 5]

Model: kvfast's transformer (vocab 256, d_model 64, 4 heads, 2 layers, d_ff
256, float64, sequential order), a 16-token prompt, ``steps`` decode steps.
Timed: median CPU time of this process (``time.process_time``, robust to other
processes on a shared machine) and median wall time, of ``repeats`` runs after
one warm-up run that compiles:

- plain: ``generate_prepared`` with the cache (prefill + ``steps`` decode steps, prepared weights);
- fast check: ``check_cache(KvfastModel, ..., scenarios=("decode",))`` in exact
  mode (the cached run, one recompute of the final sequence, two more for the
  append-invariance verification);
- per-step check: the same with ``fast=False`` (one recompute per step);
- fast check, both scenarios: ``decode`` and ``resume`` (the default mode, ``auto``), and the same in exact
  mode: on this bit-exact model the default costs at most 1.1x exact mode (it measures no order noise).

Hugging Face models (when torch and transformers are installed; ``--hf-steps``,
default 128): the tiny random Llama, GPT-2 and Mistral (a sliding window of 12, crossed by the prompt) of
:func:`kvfast.testing.tiny_model` (float32, sdpa, one torch thread), a 16-token prompt:

- plain: a cached greedy generation in torch (prefill, then one ``model(token,
  cache=...)`` per step);
- control check (decode) / (decode + resume): ``check_cache(model, ...,
  mode="control")`` with the variants kvfast builds (other attention, batch of
  two, one row at a time) and its control fast path (one recompute of the final
  sequence, batch-shape noise from four prefix recomputes).
- default (auto) check (decode + resume): not bit-exact, so judged as control mode judges: at most its cost.
- control check (rollback) / (fork) / (reorder) / (padded): each cache operation's scenario alone
  (:mod:`kvfast.check.scenarios`; the operation hooks built in for Hugging Face models).

Prints Markdown tables; the targets are fast check <= 3x plain (kvfast's model)
and control check <= 3x plain (Hugging Face models).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np

from kvfast import ModelConfig, Numerics, init_params
from kvfast.check import KvfastModel, check_cache
from kvfast.model.generation import generate_prepared
from kvfast.model.transformer import Weights

PROMPT_LEN = 16


def median_time(fn, repeats: int) -> tuple[float, float]:
    """Median CPU time (``time.process_time``) and median wall time of ``repeats`` calls after a warm-up."""
    fn()  # warm-up (compiles kernels on a cold cache)
    cpu, wall = [], []
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu), statistics.median(wall)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hf-steps", type=int, default=128, help="decode steps for the Hugging Face models (0: skip)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.repeats < 1:
        ap.error("--steps and --repeats must be >= 1")
    cfg = ModelConfig(vocab=256, d_model=64, n_head=4, n_layer=2, d_ff=256, max_pos=PROMPT_LEN + args.steps + 1)
    params = init_params(cfg, 0)
    nx = Numerics.preset("f64")
    w = Weights.prepare(cfg, params, nx)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab, PROMPT_LEN)
    model = KvfastModel(cfg, params, nx)
    report = check_cache(model, prompt, args.steps, scenarios=("decode",))
    if report.path != "fast" or not report.passed:
        raise SystemExit(f"unexpected: path {report.path}, verdict {report.verdict}")

    plain = median_time(lambda: generate_prepared(cfg, w, prompt, args.steps + 1, nx, use_cache=True), args.repeats)
    fast = median_time(lambda: check_cache(model, prompt, args.steps, scenarios=("decode",)), args.repeats)
    slow = median_time(lambda: check_cache(model, prompt, args.steps, scenarios=("decode",), fast=False), args.repeats)
    both = median_time(lambda: check_cache(model, prompt, args.steps), args.repeats)
    exact = median_time(lambda: check_cache(model, prompt, args.steps, mode="exact"), args.repeats)

    print(f"kvfast check benchmark: {args.steps} decode steps after a {PROMPT_LEN}-token prompt, {cfg}, f64")
    print(f"machine: {platform.machine()}, Python {platform.python_version()}; median of {args.repeats} runs\n")
    print("| what | CPU s | x plain (CPU) | wall s | x plain (wall) |")
    print("|---|---|---|---|---|")
    for name, (c, t) in [
        ("plain cached generation", plain),
        ("every-step check, fast path (decode)", fast),
        ("every-step check, per-step path (decode)", slow),
        ("every-step check, fast path (decode + resume)", both),
        ("the same in exact mode", exact),
    ]:
        print(f"| {name} | {c:.4f} | {c / plain[0]:.2f} | {t:.4f} | {t / plain[1]:.2f} |")
    print(f"\ntarget fast <= 3x plain (CPU time): {'met' if fast[0] <= 3 * plain[0] else 'NOT met'}")
    ratio = both[0] / exact[0]  # a bit-exact model: the default mode (auto) measures no order noise
    print(f"target default mode <= 1.1x exact mode on a bit-exact model (CPU time): {ratio:.3f}x, "
          f"{'met' if ratio <= 1.1 else 'NOT met'}")  # fmt: skip
    if args.hf_steps:
        hf_benchmark(args.hf_steps, args.repeats)
    return 0


def hf_benchmark(steps: int, repeats: int) -> None:
    """The control check on tiny Hugging Face models against a plain cached generation (see the module doc)."""
    try:
        import torch

        from kvfast.testing import tiny_model
    except ImportError:
        print("\nHugging Face benchmark skipped: torch/transformers not installed (pip install kvfast[hf])")
        return
    torch.set_num_threads(1)
    prompt = np.random.default_rng(0).integers(0, 96, PROMPT_LEN)

    def plain(model) -> None:
        with torch.no_grad():
            out = model(torch.from_numpy(prompt)[None, :], use_cache=True)
            for _ in range(steps):
                token = out.logits[0, -1].argmax().view(1, 1)
                out = model(token, cache=out.cache, use_cache=True)

    print(f"\nHugging Face models: {steps} decode steps after a {PROMPT_LEN}-token prompt, float32, sdpa, 1 thread")
    print("| model | what | CPU s | x plain (CPU) | wall s | x plain (wall) |")
    print("|---|---|---|---|---|---|")
    for family in ("llama", "gpt2", "mistral"):
        model = tiny_model(family, "float32", "sdpa", 0)
        report = check_cache(model, prompt, steps, mode="control")
        if report.verdict != "rounding" or report.path != "fast":
            raise SystemExit(f"unexpected: {family} path {report.path}, verdict {report.verdict}")
        base = median_time(lambda m=model: plain(m), repeats)
        decode = median_time(lambda m=model: check_cache(m, prompt, steps, "control", "decode"), repeats)
        both = median_time(lambda m=model: check_cache(m, prompt, steps, "control"), repeats)
        auto = median_time(lambda m=model: check_cache(m, prompt, steps), repeats)
        rows = [("plain cached generation", base), ("control check (decode)", decode)]
        rows.append(("control check (decode + resume)", both))
        rows.append((f"default (auto) check (decode + resume): {auto[0] / both[0]:.3f}x control (target <= 1)", auto))
        for op in ("rollback", "fork", "reorder", "padded"):  # each cache operation (kvfast.check.scenarios) alone
            rows.append(
                (
                    f"control check ({op})",
                    median_time(lambda m=model, o=op: check_cache(m, prompt, steps, "control", o), repeats),
                )
            )
        for name, (c, t) in rows:
            print(f"| {family} | {name} | {c:.4f} | {c / base[0]:.2f} | {t:.4f} | {t / base[1]:.2f} |")


if __name__ == "__main__":
    raise SystemExit(main())
