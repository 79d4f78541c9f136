"""A digest of many check reports, to show a change of the checker leaves every report bit for bit as it was.

    python benchmarks/check_snapshot.py > before.txt    # on one tree
    python benchmarks/check_snapshot.py > after.txt     # on the other
    diff before.txt after.txt                           # no output: every report unchanged

Each line is one case (kvfast's own model with each kind of bug, the cache operations' bugs, follow="cache", the
per-step path, the logic check, lossy caches, tiny Hugging Face models in float32 and bfloat16 through every
scenario) and the SHA-256 of its report: the rendered text, every scenario's per-step deviation, ratio, bound,
floor and tokens as bytes, the step verdicts, and the logic check's text; an exception's type and message where
the case raises. Needs kvfast[hf] for the Hugging Face cases (left out without torch, and said so).
"""

from __future__ import annotations

import hashlib
import sys

import numpy as np

from kvfast import ModelConfig, init_params
from kvfast.bugs.lossy import inject_lossy_bug
from kvfast.bugs.operations import inject_op_bug
from kvfast.check import KvfastModel, check_cache
from kvfast.check.lossy import LossyKvfastModel

CFG = ModelConfig(vocab=64, d_model=32, n_head=4, n_layer=2, d_ff=64, max_pos=64)
PROMPT = [1, 2, 3, 4, 5]
ALL = ("decode", "resume", "rollback", "fork")


def digest(run) -> str:
    """The SHA-256 of one case's report (or of its exception)."""
    h = hashlib.sha256()
    try:
        report = run()
    except Exception as exc:  # noqa: BLE001 - a case that raises is recorded as such
        h.update(f"{type(exc).__name__}: {exc}".encode())
        return "raised " + h.hexdigest()[:16]
    h.update(report.format().encode())
    for name, s in report.scenarios.items():
        h.update(name.encode() + repr(s.step_verdicts).encode())
        b = s.bounds  # (None: judged bit for bit, no bound, ratio or floor)
        for value in (s.deviation, *((None,) * 3 if b is None else (b.ratio, b.bound, b.floor)), s.tokens):
            h.update(b"-" if value is None else np.ascontiguousarray(value).tobytes())
    if report.promoted is not None:
        h.update(report.promoted.format().encode())
    return f"{report.verdict} {h.hexdigest()[:16]}"


def cases():
    params = init_params(CFG, 0)
    for bug in (None, "stale", "posfrozen", "freeze"):
        for mode in ("exact", "control"):
            for numerics in ("f64", "bf16"):
                yield (
                    f"kvfast {bug} {mode} {numerics}",
                    lambda b=bug, m=mode, n=numerics: check_cache(
                        KvfastModel(CFG, params, n, b), PROMPT, 12, mode=m, scenarios=ALL
                    ),
                )
    for op in ("crop_short", "fork_shared_keys"):
        for mode in ("exact", "control"):
            yield (
                f"operation {op} {mode}",
                lambda o=op, m=mode: check_cache(
                    inject_op_bug(KvfastModel(CFG, params, "f64"), o), PROMPT, 12, mode=m, scenarios=ALL
                ),
            )
    yield "follow=cache", lambda: check_cache(KvfastModel(CFG, params, "f64", "stale"), PROMPT, 10, follow="cache")
    yield (
        "per-step control",
        lambda: check_cache(
            KvfastModel(CFG, params, "bf16", "stale"), PROMPT, 10, fast=False, mode="control", scenarios=ALL
        ),
    )
    yield (
        "logic check",
        lambda: check_cache(KvfastModel(CFG, params, "bf16", "stale"), PROMPT, 10, mode="control", promote="float64"),
    )
    yield (
        "lossy exact",
        lambda: check_cache(LossyKvfastModel(CFG, params, "f64"), PROMPT, 10, scenarios=("decode", "fork")),
    )
    yield (
        "lossy int4 control",
        lambda: check_cache(inject_lossy_bug(LossyKvfastModel(CFG, params, "f64"), "int4"), PROMPT, 10, mode="control"),
    )
    yield "operation only", lambda: check_cache(KvfastModel(CFG, params, "f64"), PROMPT, 10, scenarios=("rollback",))
    try:
        import torch

        from kvfast.bugs.hf import inject_hf_bug
        from kvfast.check.hf import HFModel
        from kvfast.testing import tiny_model
    except ImportError:
        print("# Hugging Face cases left out: torch or transformers is not installed", file=sys.stderr)
        return
    torch.set_num_threads(1)
    every = ("decode", "resume", "rollback", "fork", "reorder", "padded")
    for family in ("llama", "gpt2"):
        for bug in (None, "posoff"):
            for dtype in ("float32", "bfloat16"):
                yield f"hf {family} {bug} {dtype}", lambda f=family, b=bug, d=dtype: check_cache(
                    inject_hf_bug(HFModel(tiny_model(f, d)), b), [3, 1, 4, 1, 5, 9], 8, mode="control",
                    scenarios=every, promote="float64" if d == "bfloat16" else None,
                )  # fmt: skip


def main() -> None:
    for name, run in cases():
        print(f"{name}: {digest(run)}", flush=True)


if __name__ == "__main__":
    main()
