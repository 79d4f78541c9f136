"""Study ``engines``: one tiny random Llama checked in transformers, onnxruntime-genai and llama.cpp.

The same weights (:func:`kvfast.testing.tiny_llama` of the config's ``seed``) are checked through
each engine's own cached path against its own recompute, in control mode, both scenarios, with the
cross-implementation variant (the weights recomputed by transformers) for the engines:

- ``engine``: ``transformers`` (:class:`kvfast.check.hf.HFModel`, its built-in variants), ``ort``
  (:class:`kvfast.check.engines.ort.ORTModel`; ``kvfast[ort]``) or ``llamacpp``
  (:class:`kvfast.check.engines.llamacpp.LlamaCppModel`; llama-cpp-python);
- ``weights`` (llama.cpp: ``f32``, ``f16``; onnxruntime-genai: ``f32`` or ``int8``, the model builder's
  weight-only int8, whose transformers variant gets the build's dequantized weights and int8 activations;
  transformers: ``f32``) and ``cache`` (llama.cpp's KV cache type ``f16``, ``f32``, ``q8_0``; the others
  ``native``);
- ``bug``: ``none`` or ``evict`` (decode drops the oldest token past 8 tokens: each engine's ``evict``, and
  transformers' ``window``), acting first at decode step ``max(1, 9 - len(prompt))``.

Each engine's model files are built once per seed into a folder shared by the runs
(:func:`model_dir`). A grid naming an engine whose package is not installed is refused before any run.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from kvfast._version import __version__
from kvfast.bugs.engine_bugs import inject_llamacpp_bug, inject_ort_bug
from kvfast.bugs.hf import inject_hf_bug
from kvfast.check.checker import check_cache
from kvfast.check.engines.llamacpp import LlamaCppModel
from kvfast.check.engines.ort import ORTModel
from kvfast.check.hf import HFModel
from kvfast.studies.common import first_bug_step, ok_rows, require_config_choice, study_of, tabled
from kvfast.studies.plotting import ratio_bars
from kvfast.sweep.study import Figure
from kvfast.testing import tiny_gguf_model, tiny_llama, tiny_ort_model
from kvfast.validation import MissingExtra, require_int

VERSION = "1"
ENGINES = {"transformers": "transformers", "ort": "onnxruntime_genai", "llamacpp": "llama_cpp"}
#: the optional extra of kvfast that installs each engine's package (torch: ``hf``)
ENGINE_EXTRAS = {"transformers": "hf", "ort": "ort", "llamacpp": "llamacpp"}
WEIGHTS = ("f32", "f16", "int8")
#: The weights each engine is built with (``ort``'s ``int8``: ``tiny_ort_model(..., precision="int8")``).
ENGINE_WEIGHTS = {"transformers": ("f32",), "ort": ("f32", "int8"), "llamacpp": ("f32", "f16")}
ORT_PRECISIONS = {"f32": "fp32", "int8": "int8"}
CACHES = ("native", "f16", "f32", "q8_0")
BUGS = ("none", "evict")
WINDOW = 8
PROMPT_LENGTHS = (5, 9)
VERDICTS = ("rounding", "inconclusive", "bug", "length-dependent")

CONFIG_FIELDS: dict[str, pa.DataType] = {
    "engine": pa.string(),
    "weights": pa.string(),
    "cache": pa.string(),
    "seed": pa.int64(),
    "prompt": pa.int64(),
    "steps": pa.int64(),
    "bug": pa.string(),
}
RESULT_FIELDS: dict[str, pa.DataType] = {
    "verdict": pa.string(),
    "decode_verdict": pa.string(),
    "resume_verdict": pa.string(),
    "ratio": pa.float64(),
    "worst_deviation": pa.float64(),
    "first_bug_step": pa.int64(),
    "acts_at": pa.int64(),
    "seconds": pa.float64(),
}


def validate_config(config: dict) -> None:
    """``ValueError`` naming the field (or the engine's missing package) before any run."""
    require_config_choice(config, "engine", tuple(ENGINES))
    engine = config["engine"]
    missing = [m for m in (ENGINES[engine], "torch") if importlib.util.find_spec(m) is None]
    if missing:
        extras = ",".join(dict.fromkeys(ENGINE_EXTRAS[engine] if m == ENGINES[engine] else "hf" for m in missing))
        raise MissingExtra(
            f"engine: {engine!r} needs {ENGINES[engine]} and torch; allowed: an installed engine "
            f"(pip install 'kvfast[{extras}]'; docs/engines.md)",
            extras,
        )
    require_config_choice(config, "weights", WEIGHTS)
    require_config_choice(config, "cache", CACHES)
    weights, cache = config["weights"], config["cache"]
    if engine != "llamacpp" and (weights not in ENGINE_WEIGHTS[engine] or cache != "native"):
        allowed = ", ".join(f"{w}/native" for w in ENGINE_WEIGHTS[engine])
        raise ValueError(f"weights/cache: {weights}/{cache} is not allowed for {engine}; allowed: {allowed}")
    if engine == "llamacpp" and weights not in ENGINE_WEIGHTS[engine]:
        raise ValueError(f"weights: {weights!r} is not allowed for llamacpp; allowed: f16, f32")
    if engine == "llamacpp" and cache == "native":
        raise ValueError("cache: 'native' is not allowed for llamacpp; allowed: f16, f32, q8_0")
    require_int(config.get("seed"), "seed", 0, 1000)
    require_int(config.get("prompt"), "prompt", 0, 1000)
    require_int(config.get("steps"), "steps", 1, 200)
    require_config_choice(config, "bug", BUGS)


def model_dir(seed: int) -> Path:
    """The tiny Llama of ``seed`` in transformers (``hf/``), and the engines' files built from it on first use,
    in a folder shared by every run of this machine (built in a temporary folder, then renamed: concurrent
    workers never see half a model)."""
    root = Path(os.environ.get("KVFAST_ENGINE_MODELS", Path(tempfile.gettempdir()) / "kvfast-engine-models"))
    return root / f"{__version__}-seed{seed}"


def _built(seed: int, engine: str, weights: str) -> Path:
    """The model file or folder of ``engine`` for ``seed`` (built once)."""
    final = model_dir(seed) / (f"{engine}-{weights}")
    if not final.exists():
        final.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=final.parent))
        if engine == "ort":
            tiny_ort_model(work, seed, ORT_PRECISIONS[weights])
        elif engine == "llamacpp":
            tiny_gguf_model(work, seed, weights)
        else:
            tiny_llama(work / "hf", seed)
        try:
            work.rename(final)
        except OSError:  # another worker finished first: use its copy
            pass
    return final


@functools.lru_cache(maxsize=16)
def _model(engine: str, weights: str, cache: str, seed: int, bug: str):
    """The model under test of a run (one per process and configuration; adapters reset on every prefill)."""
    import torch

    torch.set_num_threads(1)
    built = _built(seed, engine, weights)
    hf_dir = built / "hf"
    if engine == "ort":
        variants = ("batch", "no-opt", "transformers")
        model = ORTModel(built / "onnx", variants=variants, hf_model=hf_dir)
        return inject_ort_bug(model, None if bug == "none" else bug)
    if engine == "llamacpp":
        gguf = built / f"model-{weights}.gguf"
        model = LlamaCppModel(gguf, cache=cache, hf_model=hf_dir)
        return inject_llamacpp_bug(model, None if bug == "none" else bug)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    return inject_hf_bug(HFModel(model), None if bug == "none" else "window")


def prompt_of(config: dict) -> np.ndarray:
    """The config's prompt: ``default_rng(seed * 1000 + prompt)`` draws a prompt of ``PROMPT_LENGTHS[prompt % 2]``
    tokens in ``[3, 128)`` (no special token)."""
    rng = np.random.default_rng(config["seed"] * 1000 + config["prompt"])
    return rng.integers(3, 128, PROMPT_LENGTHS[config["prompt"] % len(PROMPT_LENGTHS)])


def run(config: dict) -> dict:
    """One control-mode check of the config's engine, both scenarios."""
    model = _model(config["engine"], config["weights"], config["cache"], config["seed"], config["bug"])
    prompt = prompt_of(config)
    start = time.perf_counter()
    report = check_cache(model, prompt, config["steps"], mode="control")
    seconds = time.perf_counter() - start
    return {
        "verdict": report.verdict,
        "decode_verdict": report.scenarios["decode"].verdict,
        "resume_verdict": report.scenarios["resume"].verdict,
        "ratio": report.max_ratio,
        "worst_deviation": float(report.max_deviation),
        "first_bug_step": first_bug_step(report),
        "acts_at": -1 if config["bug"] == "none" else max(1, WINDOW + 1 - len(prompt)),
        "seconds": seconds,
    }


@tabled()
def summarize(df: pd.DataFrame) -> Iterator[dict]:
    """Per engine, weights and KV cache: clean runs by verdict and their largest ratio; bugged runs found at the
    step where the bug first acts and their smallest ratio at that step's scenario maximum."""
    ok = ok_rows(df)
    for (engine, weights, cache), g in ok.groupby(["engine", "weights", "cache"], sort=True) if len(ok) else ():
        clean, bugged = g[g["bug"] == "none"], g[g["bug"] != "none"]
        row = {"engine": engine, "weights": weights, "cache": cache, "clean_runs": len(clean)}
        row.update({f"clean_{v}": int((clean["verdict"] == v).sum()) for v in VERDICTS})
        row["largest_clean_ratio"] = float(clean["ratio"].max()) if len(clean) else np.nan
        row["bugged_runs"] = len(bugged)
        row["bug_at_first_acting_step"] = int((bugged["first_bug_step"] == bugged["acts_at"]).sum())
        row["smallest_bug_ratio"] = float(bugged["ratio"].min()) if len(bugged) else np.nan
        yield row


def _draw_engines(df: pd.DataFrame, table: pd.DataFrame):
    """Per engine, weights and KV cache: the largest clean ratio against the smallest bugged ratio (log scale)."""
    labels = [f"{e}\n{w} / {c}" for e, w, c in zip(table["engine"], table["weights"], table["cache"], strict=True)]
    return ratio_bars(
        labels,
        table["largest_clean_ratio"],
        table["smallest_bug_ratio"],
        bugged_label="smallest ratio, eviction",
        line=4.0,
        line_label="margin (rounding below)",
        floor=1e-4,
        ylabel="deviation / bound (log)",
        title="The same weights in every engine: clean runs under the margin, an injected eviction far above",
        figsize=(10, 4),
    )


FIGURES = (
    Figure(
        "engines",
        "Inference engines: clean verdicts and an injected eviction on the same tiny Llama",
        "One tiny random Llama per seed, checked in transformers, onnxruntime-genai and llama.cpp (its weight and KV "
        "cache types) in control mode, both scenarios. Green: the largest clean ratio of each configuration (rounding "
        "while below the dashed margin of 4); red: the smallest ratio of the runs with an injected eviction.",
        summarize,
        _draw_engines,
    ),
)

STUDY = study_of(
    globals(),
    "engines",
    "one tiny Llama checked in transformers, onnxruntime-genai and llama.cpp (needs the engines)",
    claims=None,  # a comparison of engines, no claim of the seed's
    rank=120,
    reproduce=False,
)
