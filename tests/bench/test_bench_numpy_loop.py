"""benchmarks/numpy_loop.py's NumPy baseline does the same work as kvfast: its logits agree with kvfast's f64.

BLAS adds in its own order, so the bits differ from kvfast's explicit-order kernels: the agreement is
relative (1e-12 of the largest logit), not ``==``.
"""

from __future__ import annotations

import importlib.util

import numpy as np
from shared import ROOT

from kvfast.studies import exactness

SPEC = importlib.util.spec_from_file_location("bench_numpy_loop", ROOT / "benchmarks" / "numpy_loop.py")
numpy_loop = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(numpy_loop)

CONFIG = {
    "seed": 1, "n_layer": 2, "n_head": 4, "d_model": 32, "d_ff": 64, "vocab": 32,
    "prompt_len": 3, "steps": 5, "order": "sequential", "preset": "f64",
}  # fmt: skip


def test_numpy_baseline_matches_kvfast_f64_logits():
    mine = numpy_loop.numpy_generate(CONFIG)
    kv = exactness.run(CONFIG)
    assert mine["tokens"] == kv["tokens"]
    tokens = [*exactness.prompt_for(CONFIG), *map(int, mine["tokens"].split(",")[:-1])]
    ref = numpy_loop.kvfast_logits(CONFIG, tokens)
    # one row per prompt position, then one per decode step: the rows of a forward of the whole sequence
    assert mine["cache_logits"].shape == ref.shape == (CONFIG["prompt_len"] + CONFIG["steps"] - 1, CONFIG["vocab"])
    scale = np.abs(ref).max()
    assert np.abs(mine["cache_logits"] - ref).max() <= 1e-12 * scale
    assert np.abs(mine["recompute_logits"] - ref).max() <= 1e-12 * scale
    rel, same_tokens = numpy_loop.agreement(CONFIG)
    assert rel <= 1e-12 and same_tokens


def test_numpy_baseline_sees_a_broken_cache():
    """The baseline's comparison can fail: a cache that drops its last key moves the decode logits."""
    params = exactness.model_for(CONFIG)[1]
    clean = numpy_loop.numpy_generate(CONFIG, params)
    assert clean["max_abs_dev"] < 1e-12 * np.abs(clean["recompute_logits"]).max()
    real_attention = numpy_loop.attention

    def forgetful(q, k, v, n_head, pos0):
        if q.shape[0] == 1 and k.shape[0] > 1:  # a decode step: attend to every key but the newest
            return real_attention(q, k[:-1], v[:-1], n_head, pos0 - 1)
        return real_attention(q, k, v, n_head, pos0)

    numpy_loop.attention = forgetful
    try:
        broken = numpy_loop.numpy_generate(CONFIG, params)
    finally:
        numpy_loop.attention = real_attention
    assert broken["first_bad_step"] == 1 and broken["max_abs_dev"] > 1e-6
