"""Real kernels' attention orders (online softmax, split-KV, split-KV by count) against naive twins.

The twins below are plain Python written from the formulas in
:mod:`kvfast.kernels.attention`'s docstring: scalar roundings through the
kernels' own ``rnd`` and ``exp``/``log``, sums in an independent sequential or
pairwise (aligned binary tree) implementation. Where the order is the same the
kernel must equal its twin bit for bit.
"""

from __future__ import annotations

import itertools
import math

import numba as nb
import numpy as np
import pytest

from kvfast import ModelConfig, Numerics, generate, init_params
from kvfast.kernels.attention import (
    ATTENTION_CODES,
    ONLINE,
    SPLITCOUNT,
    SPLITKV,
    STANDARD,
    attention_into,
    block_edges,
)
from kvfast.kernels.precision import BF16, F32, F64, rnd
from kvfast.kernels.reduce import PAIRWISE, SEQUENTIAL
from kvfast.model.transformer import Weights, loss_and_grads_prepared


@nb.njit(cache=True)
def _exp(x: float) -> float:
    return math.exp(x)


@nb.njit(cache=True)
def _log(x: float) -> float:
    return math.log(x)


def r(x: float, fmt: int) -> float:
    return float(rnd(float(x), fmt))


def _tree(terms: list[float], acc: int) -> float:
    if len(terms) == 1:
        return terms[0]
    half = len(terms) // 2
    return r(_tree(terms[:half], acc) + _tree(terms[half:], acc), acc)


def osum(terms: list[float], acc: int, order: int) -> float:
    """Sum in ``order``; every term rounded to ``acc`` as it enters."""
    terms = [r(t, acc) for t in terms]
    if not terms:
        return 0.0
    if order == SEQUENTIAL:
        s = terms[0]
        for t in terms[1:]:
            s = r(s + t, acc)
        return s
    # pairwise: the maximal aligned power-of-two blocks of n, largest first, each a balanced tree
    parts, i, n = [], 0, len(terms)
    for bit in reversed(range(n.bit_length())):
        size = 1 << bit
        if n & size:
            parts.append(_tree(terms[i : i + size], acc))
            i += size
    s = parts[0]
    for p in parts[1:]:
        s = r(s + p, acc)
    return s


def odot(a, b, acc: int, order: int) -> float:
    return osum([r(x * y, acc) for x, y in zip(a, b, strict=True)], acc, order)


def blocks_of(lo: int, hi: int, span_lo: int, span_hi: int, mode: int, param: int) -> list[list[int]]:
    """Key positions lo..hi-1 grouped into the mode's blocks (independent of block_edges)."""
    if mode == SPLITCOUNT:
        starts = [span_lo + (i * (span_hi - span_lo)) // param for i in range(param)]

        def key(j: int) -> int:
            return max(i for i, s in enumerate(starts) if s <= j)
    else:

        def key(j: int) -> int:
            return j // param

    return [list(g) for _, g in itertools.groupby(range(lo, hi), key=key)]


def ref_row(q, K, V, lo, hi, span, n_head, scale, st, acc, order, mode, param) -> np.ndarray:
    d = q.shape[0]
    hd = d // n_head
    out = np.empty(d)
    for h in range(n_head):
        cols = range(h * hd, (h + 1) * hd)
        qh = [q[c] for c in cols]
        s = {j: r(odot(qh, [K[j, c] for c in cols], acc, order) * scale, st) for j in range(lo, hi)}
        if mode == STANDARD:
            m = max(s.values())
            e = {j: r(_exp(s[j] - m), st) for j in s}
            z = osum([e[j] for j in range(lo, hi)], acc, order)
            p = [r(e[j] / z, st) for j in range(lo, hi)]
            for c in cols:
                out[c] = r(osum([r(p[i] * V[lo + i, c], acc) for i in range(hi - lo)], acc, order), st)
            continue
        blocks = blocks_of(lo, hi, span[0], span[1], mode, param)
        if mode == ONLINE:
            m, lsum, o = -math.inf, 0.0, [0.0] * hd
            for blk in blocks:
                mnew = max(m, max(s[j] for j in blk))
                alpha = r(_exp(m - mnew), acc)
                e = [r(_exp(s[j] - mnew), st) for j in blk]
                lsum = r(r(alpha * lsum, acc) + osum(e, acc, order), acc)
                for i, c in enumerate(cols):
                    part = osum([r(e[k] * V[j, c], acc) for k, j in enumerate(blk)], acc, order)
                    o[i] = r(r(alpha * o[i], acc) + part, acc)
                m = mnew
            for i, c in enumerate(cols):
                out[c] = r(o[i] / lsum, st)
            continue
        outs, lses = [], []
        for blk in blocks:
            mb = max(s[j] for j in blk)
            e = [r(_exp(s[j] - mb), st) for j in blk]
            lb = osum(e, acc, order)
            outs.append(
                [r(osum([r(e[k] * V[j, c], acc) for k, j in enumerate(blk)], acc, order) / lb, acc) for c in cols]
            )
            lses.append(r(mb + r(_log(lb), acc), acc))
        big = max(lses)
        w = [r(_exp(x - big), acc) for x in lses]
        wsum = w[0]
        for x in w[1:]:
            wsum = r(wsum + x, acc)
        for i, c in enumerate(cols):
            total = None
            for b in range(len(blocks)):
                t = r(r(w[b] / wsum, acc) * outs[b][i], acc)
                total = t if total is None else r(total + t, acc)
            out[c] = r(total, st)
    return out


def _inputs(seed: int, T: int, d: int, st: int):
    rng = np.random.default_rng(seed)
    q, k, v = (np.array([[r(x, st) for x in row] for row in rng.standard_normal((T, d)) * 1.5]) for _ in range(3))
    return q, k, v


def _kernel(q, k, v, n_head, st, acc, order, mode, param):
    T, d = q.shape
    out = np.empty((T, d))
    scale = 1.0 / math.sqrt(d // n_head)
    attention_into(q, k, v, 0, T, True, n_head, scale, st, acc, order, out, np.empty((0, 0, 0)), mode, param)
    return out


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint64)


CASES = [
    (STANDARD, 0),
    (ONLINE, 1),
    (ONLINE, 3),
    (ONLINE, 16),
    (SPLITKV, 2),
    (SPLITKV, 5),
    (SPLITCOUNT, 2),
    (SPLITCOUNT, 3),
]
FORMATS = [(F64, F64), (F32, F32), (BF16, F32), (BF16, F64), (BF16, BF16), (F64, BF16)]


@pytest.mark.parametrize(("st", "acc"), FORMATS)
@pytest.mark.parametrize(("mode", "param"), CASES)
def test_kernel_equals_naive_twin_bit_for_bit(mode, param, st, acc):
    T, d, n_head = 9, 8, 2
    q, k, v = _inputs(17 + mode, T, d, st)
    scale = 1.0 / math.sqrt(d // n_head)
    for order in (SEQUENTIAL, PAIRWISE):
        got = _kernel(q, k, v, n_head, st, acc, order, mode, param)
        want = np.stack(
            [ref_row(q[t], k, v, 0, t + 1, (0, T), n_head, scale, st, acc, order, mode, param) for t in range(T)]
        )
        assert (_bits(got) == _bits(want)).all(), (mode, param, st, acc, order)


def test_block_edges_aligned_and_by_count():
    assert list(block_edges(0, 10, 0, 10, ONLINE, 4)) == [0, 4, 8, 10]
    assert list(block_edges(5, 10, 0, 10, SPLITKV, 4)) == [5, 8, 10]
    assert list(block_edges(0, 3, 0, 3, ONLINE, 4)) == [0, 3]
    # by count: boundaries at span_lo + i*len//n, clipped to the row's keys
    assert list(block_edges(0, 10, 0, 10, SPLITCOUNT, 3)) == [0, 3, 6, 10]
    assert list(block_edges(0, 5, 0, 10, SPLITCOUNT, 3)) == [0, 3, 5]
    assert list(block_edges(0, 5, 0, 5, SPLITCOUNT, 3)) == [0, 1, 3, 5]
    assert list(block_edges(0, 2, 0, 2, SPLITCOUNT, 4)) == [0, 1, 2]


@pytest.mark.parametrize(("st", "acc"), [(F64, F64), (BF16, F32), (BF16, BF16)])
def test_real_kernel_orders_differ_from_standard(st, acc):
    """Each real kernel's order gives different bits than the standard softmax on this input."""
    q, k, v = _inputs(3, 16, 8, st)
    std = _kernel(q, k, v, 2, st, acc, SEQUENTIAL, STANDARD, 0)
    outs = {}
    for mode, param in [(ONLINE, 4), (SPLITKV, 4), (SPLITCOUNT, 3)]:
        outs[mode] = _kernel(q, k, v, 2, st, acc, SEQUENTIAL, mode, param)
        assert (_bits(outs[mode]) != _bits(std)).any(), mode
    assert (_bits(outs[SPLITKV]) != _bits(outs[ONLINE])).any()
    assert (_bits(outs[SPLITCOUNT]) != _bits(outs[SPLITKV])).any()


def _model(n_layer: int):
    cfg = ModelConfig(vocab=32, d_model=16, n_head=2, n_layer=n_layer, d_ff=32, max_pos=28)
    return cfg, init_params(cfg, 5)


@pytest.mark.parametrize("preset", ["f64", "f32", "bf16"])
@pytest.mark.parametrize(("attention", "block"), [("online", 4), ("online", 3), ("splitkv", 4), ("splitkv", 5)])
def test_aligned_blocks_keep_the_cache_bit_exact(preset, attention, block):
    cfg, params = _model(2)
    prompt = np.array([3, 1, 4, 1, 5, 9, 2], dtype=np.int64)
    nx = Numerics.preset(preset, "pairwise", attention, block)
    t_c, l_c = generate(cfg, params, prompt, 16, nx, use_cache=True)
    t_f, l_f = generate(cfg, params, prompt, 16, nx, use_cache=False)
    assert (_bits(l_c) == _bits(l_f)).all()
    assert (t_c == t_f).all()


@pytest.mark.parametrize("preset", ["f64", "f32", "bf16"])
def test_count_based_splits_break_the_cache(preset):
    """Split by count: a prompt row is cut by the prefill's span, a recompute's row by the longer span."""
    cfg, params = _model(2)
    prompt = np.array([3, 1, 4, 1, 5, 9, 2], dtype=np.int64)
    nx = Numerics.preset(preset, "sequential", "splitcount", 3)
    _, l_c = generate(cfg, params, prompt, 16, nx, use_cache=True)
    _, l_f = generate(cfg, params, prompt, 16, nx, use_cache=False)
    assert (_bits(l_c[0]) == _bits(l_f[0])).all()  # step 0 is the prompt's own forward in both
    assert (_bits(l_c) != _bits(l_f)).any()


def test_count_based_splits_are_exact_with_one_layer():
    """With one layer the cached K/V come from embeddings only, so moving boundaries touch only the
    current row, which a decode and the recompute's last row cut the same way (span = 0..pos)."""
    cfg, params = _model(1)
    prompt = np.array([3, 1, 4, 1, 5, 9, 2], dtype=np.int64)
    nx = Numerics.preset("bf16", "sequential", "splitcount", 3)
    _, l_c = generate(cfg, params, prompt, 16, nx, use_cache=True)
    _, l_f = generate(cfg, params, prompt, 16, nx, use_cache=False)
    assert (_bits(l_c) == _bits(l_f)).all()


def test_numerics_attention_fields_validate():
    assert Numerics() == Numerics("f64", "f64", "sequential", "standard", 0)
    assert Numerics(attention="online").attn_block == 4
    assert Numerics(attention="splitcount").attn_block == 2
    assert Numerics(attention="splitkv", attn_block=7).attention_codes == (ATTENTION_CODES["splitkv"], 7)
    assert Numerics.preset("bf16", "pairwise", "online", 8).name == "bf16/f32/pairwise/online8"
    assert Numerics.preset("bf16").name == "bf16/f32/sequential"
    with pytest.raises(ValueError, match=r"attention: 'flash' .*allowed: online, splitcount, splitkv, standard"):
        Numerics(attention="flash")
    with pytest.raises(ValueError, match=r"attn_block: -1 .*allowed: an integer >= 0"):
        Numerics(attention="online", attn_block=-1)
    with pytest.raises(ValueError, match=r"attn_block: True"):
        Numerics(attention="online", attn_block=True)
    with pytest.raises(ValueError, match=r"attn_block: 4 .*standard.*allowed: 0"):
        Numerics(attn_block=4)


def test_no_backward_in_real_kernel_orders():
    cfg, params = _model(1)
    nx = Numerics(attention="online")
    w = Weights.prepare(cfg, params, nx)
    tokens = np.array([1, 2, 3], dtype=np.int64)
    with pytest.raises(ValueError, match="numerics.attention: 'online'"):
        loss_and_grads_prepared(cfg, w, tokens, tokens, nx)
