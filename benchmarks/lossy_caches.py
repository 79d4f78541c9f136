"""Lossy (quantized) caches through the check: measured error against the cache unquantized vs the format's.

    .venv/bin/python benchmarks/lossy_caches.py [--steps 32]

Prints a Markdown table, one row per model and cache: the check's verdict (control mode, scenarios decode,
resume and fork, a 16-token prompt), the largest measured error (|lossy - lossless| logits), the largest
expected error of the format (kvfast's own round trip on the lossless cache) and the largest ratio of the
two (see kvfast.check.lossy). Models: kvfast's own (vocab 64, d_model 32, f64) with an int8 and an fp8
cache and the "int8 that stores 4 bits" bug; the tiny random Hugging Face Llama, GPT-2 and Qwen2 (float32
and bfloat16) with transformers' fp8 QuantizedCache (built in), and the float32 Llama with a 4-bit
quanto and HQQ QuantizedCache where those packages import (groups of 8, a residual of 4 positions; scenarios
decode and resume: quanto's tensors cannot be deep-copied, so no fork); neither is a dependency of kvfast,
and a backend that does not import gets no row.
"""

from __future__ import annotations

import argparse
import importlib.util

import numpy as np

from kvfast import ModelConfig, init_params
from kvfast.bugs.lossy import inject_lossy_bug
from kvfast.check import check_cache
from kvfast.check.lossy import LossyKvfastModel

SCENARIOS = ("decode", "resume", "fork")


#: transformers' group-wise backends: the module each needs, and the tiny models' settings (groups of 8:
#: the default 64 divides no tiny tensor; a residual of 4: the default 128 outlasts the run).
GROUPWISE = {"quanto": "optimum.quanto", "hqq": "hqq"}
GROUPWISE_KWARGS = dict(nbits=4, q_group_size=8, residual_length=4)


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package (optimum) is absent
        return False


def row(name: str, model, prompt, steps: int, scenarios: tuple[str, ...] = SCENARIOS) -> str:
    report = check_cache(model, prompt, steps, mode="control", scenarios=scenarios)
    ran = list(report.scenarios.values())
    measured = max(float(s.deviation.max()) for s in ran)
    expected = max(float(s.bounds.floor.max()) for s in ran)
    return f"| {name} | {report.verdict} | {measured:.3g} | {expected:.3g} | {report.max_ratio:.3g} |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args(argv)
    prompt = list(np.random.default_rng(0).integers(0, 64, 16))
    cfg = ModelConfig(vocab=64, d_model=32, n_head=4, n_layer=2, d_ff=64, max_pos=16 + args.steps + 1)
    params = init_params(cfg, 0)
    print(f"lossy caches, control mode, {args.steps} steps, scenarios {', '.join(SCENARIOS)}\n")
    print("| model and cache | verdict | largest measured error | largest expected error | largest ratio |")
    print("|---|---|---|---|---|")
    for fmt, bug in (("int8", None), ("fp8", None), ("int8", "int4")):
        name = f"kvfast f64, {fmt} cache" + (f" (bug: stores {bug})" if bug else "")
        print(row(name, inject_lossy_bug(LossyKvfastModel(cfg, params, "f64", fmt=fmt), bug), prompt, args.steps))
    try:
        import torch
        import transformers

        from kvfast.check.hf import HFModel
        from kvfast.testing import tiny_model
    except ImportError:
        return 0
    torch.set_num_threads(1)
    for family in ("llama", "gpt2", "qwen2"):
        for dtype in ("float32", "bfloat16"):
            m = tiny_model(family, dtype, "sdpa", 0)
            adapter = HFModel(m, new_cache=lambda m=m: transformers.QuantizedCache("fp8", m.config))
            print(row(f"{family} {dtype}, QuantizedCache fp8", adapter, prompt, args.steps))
    m = tiny_model("llama", "float32", "sdpa", 0)
    for backend, module in GROUPWISE.items():
        if importable(module):
            make = lambda b=backend: transformers.QuantizedCache(b, m.config, **GROUPWISE_KWARGS)  # noqa: E731
            name = f"llama float32, QuantizedCache {backend} int4 (decode, resume)"
            print(row(name, HFModel(m, new_cache=make), prompt, args.steps, ("decode", "resume")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
