"""The compiled forward and the per-format entries give the same bits as the code they replace.

- ``matmul_with`` called from jitted code with a literal format against ``matmul_into`` called
  from Python (the run-time dispatch), on random cases in every storage, accumulator and order;
  and every format a process runs shares one compiled forward and one decode;
- the compiled forward (``forward_prepared`` without a tape) against the layer-by-layer Python
  forward (``forward_layers``) in every preset, order and attention kernel, with and without a
  cache, causal or not: logits, the residual stream and K/V of the trace, the cache's buffers.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numba as nb
import numpy as np
import pytest
from shared import ROOT

from kvfast import ModelConfig, Numerics, init_params
from kvfast.kernels.matmul import matmul_into, matmul_with, product_bodies
from kvfast.kernels.precision import BF16, F32, F64, round_array
from kvfast.kernels.reduce import PAIRWISE, SEQUENTIAL
from kvfast.model.cache import KVCache
from kvfast.model.transformer import Weights, forward_layers, forward_prepared

FORMATS = (F64, F32, BF16)


def bits(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, dtype=np.float64)).view(np.uint64)


def same_bits(a, b) -> bool:
    """Equal bit patterns; NaN compared as NaN (which NaN's sign survives an add is the compiler's)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return False
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b)) and np.array_equal(bits(a[~nan]), bits(b[~nan])))


def _literal_matmul(storage: int, acc: int):
    """``matmul_with`` (the form jitted code calls, with the product bodies' addresses) called from jitted code
    with ``storage``/``acc`` as compile-time constants."""

    @nb.njit(fastmath=False, error_model="numpy")
    def run(x, w, order, y, bodies):
        matmul_with(x, w, storage, acc, order, y, bodies)

    return lambda x, w, order, y: run(x, w, order, y, product_bodies(acc))


def _random_matrix(rng, shape, fmt, kind):
    a = rng.standard_normal(shape) * np.exp2(rng.integers(-8, 9, size=shape))
    if kind == "specials" and a.size:
        flat = a.ravel()
        idx = rng.integers(0, a.size, size=max(1, a.size // 8))
        flat[idx] = rng.choice([np.inf, -np.inf, np.nan, 0.0, -0.0, 3.0e38, 1e-40], size=idx.size)
    if kind != "off-grid":
        a = round_array(a, fmt)
    return a


def literal_pairs() -> list:
    """Every storage x accumulator pair; in the default run a Latin set of three (each storage and each
    accumulator once, two of them mixed: (F64, F64), (F32, BF16), (BF16, F32)), the other six -m slow (each pair
    is its own Numba compilation, a few seconds on 2 cores)."""
    return [
        (s, a) if (FORMATS.index(s) + FORMATS.index(a)) % 3 == 0 else pytest.param(s, a, marks=pytest.mark.slow)
        for s in FORMATS
        for a in FORMATS
    ]


@pytest.mark.parametrize(("storage", "acc"), literal_pairs())
def test_matmul_into_with_a_literal_format_equals_the_run_time_dispatch(storage, acc):
    rng = np.random.default_rng([20261130, storage, acc])
    counts = {"cases": 0, "elements": 0}
    run = _literal_matmul(storage, acc)
    for case in range(60):
        T, n, m = int(rng.integers(0, 10)), int(rng.integers(0, 21)), int(rng.integers(0, 21))
        kind = ("on-grid", "off-grid", "specials")[case % 3]
        x = _random_matrix(rng, (T, n), acc, kind)
        w = _random_matrix(rng, (n, m), acc, kind)
        for order in (SEQUENTIAL, PAIRWISE):
            want, got = np.empty((T, m)), np.empty((T, m))
            matmul_into(x, w, storage, acc, order, want)
            run(x, w, order, got)
            assert same_bits(got, want), (storage, acc, order, T, n, m, kind)
            counts["cases"] += 1
            counts["elements"] += got.size
    assert counts["cases"] == 60 * 2 and counts["elements"] > 1_000  # about 5,000 expected per pair


_COMPILED_FORMATS = """
import sys
import numpy as np
import kvfast
from kvfast.model.compiled import forward_kernel
from kvfast.model.generation import decode_kernel
cfg = kvfast.ModelConfig(vocab=11, d_model=8, n_head=2, n_layer=2, d_ff=8, max_pos=8)
params = kvfast.init_params(cfg, 0)
for storage, accum in [p.split(",") for p in sys.argv[1:]]:
    kvfast.generate(cfg, params, np.arange(3), 3, kvfast.Numerics(storage, accum))
print(len(forward_kernel.signatures), len(decode_kernel.signatures))
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("pairs", [["f64,f64"], ["f64,f64", "f32,f32", "bf16,f32", "f64,bf16", "bf16,bf16"]])
def test_every_format_runs_one_compiled_forward_and_one_decode(pairs):
    """The formats reach the compiled entries as run-time values, so every storage/accumulator pair a
    process runs shares one forward and one decode (each format's matmul body is chosen inside
    ``matmul_into``): a cold start compiles them once for a whole ``kvfast reproduce``, and a warm one
    loads two entries. (Per-format entries, the formats as compile-time constants, would give one
    signature per pair: the five-pair case fails.)"""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    out = subprocess.run(
        [sys.executable, "-c", _COMPILED_FORMATS, *pairs], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.split("\n")[-2] == "1 1"


NUMERICS = [
    Numerics.preset(p, order=o, attention=a)
    for p in ("f64", "f32", "bf16")
    for o in ("sequential", "pairwise")
    for a in ("standard", "online", "splitkv", "splitcount")
] + [Numerics("bf16", "bf16"), Numerics("f32", "f64"), Numerics("f64", "bf16")]


@pytest.mark.parametrize("nx", NUMERICS, ids=lambda nx: nx.name)
def test_compiled_forward_equals_the_layer_by_layer_forward(nx):
    rng = np.random.default_rng(7)
    for seed, (n_layer, n_head, d) in enumerate([(1, 1, 8), (2, 2, 8), (3, 4, 16), (2, 3, 12)]):
        cfg = ModelConfig(vocab=19, d_model=d, n_head=n_head, n_layer=n_layer, d_ff=2 * d + 3, max_pos=40)
        w = Weights.prepare(cfg, init_params(cfg, seed), nx)
        tokens = rng.integers(0, cfg.vocab, size=int(rng.integers(1, 14))).astype(np.int64)
        for causal in (True, False):
            got_trace: dict = {}
            want_trace: dict = {}
            got = forward_prepared(cfg, w, tokens, nx, causal=causal, trace=got_trace)
            want = forward_layers(cfg, w, tokens, nx, causal=causal, trace=want_trace)
            assert same_bits(got, want), (seed, causal)
            for key in ("resid", "k", "v"):
                assert same_bits(np.stack(got_trace[key]), np.stack(want_trace[key])), (seed, causal, key)
        # with a cache: a prefill, then a continuation of several rows (pos0 > 0)
        split = int(rng.integers(1, tokens.shape[0] + 1))
        caches = [KVCache.empty(cfg, nx, 30), KVCache.empty(cfg, nx, 30)]
        logits = []
        for fn, cache in zip((forward_prepared, forward_layers), caches, strict=True):
            first = fn(cfg, w, tokens[:split], nx, cache)
            rest = fn(cfg, w, tokens[split:], nx, cache) if split < tokens.shape[0] else first[:0]
            logits.append(np.concatenate([first, rest]))
        assert same_bits(logits[0], logits[1]), seed
        assert caches[0].length == caches[1].length == tokens.shape[0]
        assert caches[0].prefill_len == caches[1].prefill_len
        assert same_bits(caches[0].k, caches[1].k) and same_bits(caches[0].v, caches[1].v)


def test_the_compiled_forward_is_not_the_layer_by_layer_code_path():
    """Control: the two paths share the block (:mod:`kvfast.model.block`) but not the loop over
    layers, the K/V store and the attention call (the compiled one makes no Python call per layer),
    so the equality above tests the compiled path's plumbing against the textbook one."""
    from kvfast.model import layers

    calls = []
    original = layers.attention_forward

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    cfg = ModelConfig(vocab=11, d_model=8, n_head=2, n_layer=2, d_ff=8, max_pos=8)
    nx = Numerics()
    w = Weights.prepare(cfg, init_params(cfg, 0), nx)
    layers.attention_forward = counting
    try:
        forward_prepared(cfg, w, np.arange(4), nx)
        assert not calls
        forward_layers(cfg, w, np.arange(4), nx)
        assert len(calls) == cfg.n_layer
    finally:
        layers.attention_forward = original


def test_prepared_weights_have_the_type_the_block_is_compiled_for_by_address():
    """The compiled forward and the decode call the block's functions by address (``kvfast.model.compiled``:
    ``block_input_at``, ``block_output_at``, ``head_at``), which type only the argument types they are compiled
    for: the prepared weights, fresh or cached (the caller's parameters frozen), always have them; weights of
    another type are a typing error, never a call of code compiled for another layout."""
    from kvfast.kernels.precision import Formats
    from kvfast.model import compiled

    cfg = ModelConfig(vocab=7, d_model=8, n_head=2, n_layer=2, d_ff=12, max_pos=8)
    params = init_params(cfg, 0)
    for weights in (Weights.prepare(cfg, params, Numerics()), Weights.cached(cfg, params, Numerics("bf16"))):
        assert nb.typeof(weights.stacked) == compiled.WEIGHTS

    @nb.njit
    def head(kern, w, x, logits):
        kern, w, fmt = compiled.named(kern, w, (0, 0, 0))
        compiled.head_at(kern.head, kern, w, 1e-5, fmt, x, np.empty_like(x), np.empty(x.shape[0]), logits)

    w = Weights.prepare(cfg, params, Numerics()).stacked
    x = np.zeros((1, cfg.d_model))
    kern = compiled.kernels(0, 0)
    logits = np.empty((1, cfg.vocab))
    head(kern, tuple(w), x, logits)  # the layout it is compiled for: a call

    @nb.njit
    def formats(kern, w):
        return compiled.named(kern, w, (0, 0, 0))[2]

    got = formats(kern, tuple(w))  # named in compiled code: the record itself
    assert got == Formats(0, 0, 0) and type(got) is Formats
    other = w._replace(wte=np.asfortranarray(w.wte))  # the same values in another layout
    with pytest.raises(nb.core.errors.TypingError):
        head(kern, tuple(other), x, logits)


@pytest.mark.parametrize("preset", ["f64", "f32", "bf16"])
@pytest.mark.parametrize("order", ["sequential", "pairwise"])
def test_the_product_size_class_never_changes_the_model(preset, order, monkeypatch):
    """The compiled forward and decode with the small class's product bodies (plain) and with the large
    class's (unrolled; ``kvfast.model.compiled.model_size_class`` forced either way): the same logits, K/V
    and cache, bit for bit; the class only picks which bodies a process compiles."""
    from kvfast.model import compiled, generation

    cfg = ModelConfig(vocab=37, d_model=16, n_head=2, n_layer=2, d_ff=40, max_pos=24)
    nx = Numerics.preset(preset, order=order)
    params = init_params(cfg, 3)
    tokens = np.random.default_rng(8).integers(0, cfg.vocab, size=9).astype(np.int64)
    results = []
    for large in (False, True):
        monkeypatch.setattr(compiled, "model_size_class", lambda config, acc, large=large: large)
        w = Weights.prepare(cfg, params, nx)  # fresh: its leading_args (the table of kernels) made in this class
        cache = KVCache.empty(cfg, nx, 20)
        logits = [forward_prepared(cfg, w, tokens[:5], nx, cache)]
        for t in tokens[5:]:
            logits.append(generation.decode_prepared(cfg, w, cache, int(t), nx)[None])
        results.append((np.concatenate(logits), cache.k.copy(), cache.v.copy()))
    for got, want in zip(results[0], results[1], strict=True):
        assert same_bits(got, want)


def test_first_max_is_numpys_argmax():
    """The token the compiled greedy decode feeds: the first maximum, or the first NaN (NumPy's argmax)."""
    from kvfast.model.generation import first_max

    rng = np.random.default_rng(5)
    rows = [
        np.array([1.0, 3.0, 3.0, 2.0]), np.array([-0.0, 0.0]), np.array([0.0, -0.0]), np.array([np.nan, 1.0]),
        np.array([1.0, np.nan, 5.0, np.nan]), np.array([-np.inf, -np.inf]), np.array([1.0, np.inf, np.inf]),
        np.array([7.0]), *(rng.integers(0, 4, size=9).astype(np.float64) for _ in range(50)),
    ]  # fmt: skip
    for row in rows:
        assert first_max(row) == int(np.argmax(row)), row
    # control: the rows tell the first maximum from the last, and a NaN from the largest number
    assert any(len(row) - 1 - int(np.argmax(row[::-1])) != int(np.argmax(row)) for row in rows)
    assert any(int(np.nanargmax(row)) != int(np.argmax(row)) for row in rows)


def test_a_copy_or_pickle_of_weights_carries_no_code_addresses():
    """``Weights.calls`` holds this process's machine-code addresses: a pickle (another process) or a copy starts
    without them. Control: the weights themselves keep theirs."""
    import copy
    import dataclasses
    import pickle

    cfg = ModelConfig(vocab=8, d_model=8, n_head=2, n_layer=1, d_ff=8, max_pos=8)
    numerics = Numerics.preset("f64")
    weights = Weights.prepare(cfg, init_params(cfg, 0), numerics)
    weights.leading_args(cfg, numerics)
    assert len(weights.calls) == 1
    for twin in (pickle.loads(pickle.dumps(weights)), copy.copy(weights), dataclasses.replace(weights)):
        assert twin.calls == {}
        assert all((twin.named[k] == weights.named[k]).all() for k in weights.named)
