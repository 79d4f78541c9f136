"""Exactness claims of the model: append invariance, mask-off, cache exactness, save/load.

Every claim here is an equality, asserted on bit patterns (``==`` on uint64 views),
in all three presets and both summation orders, over several seeds, depths, head
counts and prompt lengths. (Tolerance checks - the independent float64 reference and
the gradient check - are in ``test_model_reference.py``.)
"""

from __future__ import annotations

import numpy as np
import pytest

from kvfast import (
    KVCache,
    ModelConfig,
    Numerics,
    decode_step,
    forward,
    forward_trace,
    generate,
    init_params,
    load_params,
    save_params,
)

PRESETS = ("f64", "f32", "bf16")
ORDERS = ("sequential", "pairwise")

# (seed, n_layer, n_head, d_model, prompt length, steps)
CASES = [
    (0, 1, 1, 8, 1, 6),
    (1, 2, 2, 8, 3, 5),
    (2, 3, 4, 16, 7, 4),
    (3, 2, 1, 12, 12, 3),
    (4, 4, 2, 8, 5, 6),
    (5, 2, 4, 8, 2, 8),
    (6, 1, 2, 16, 9, 5),
    (7, 3, 3, 12, 4, 7),
]


def bits(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, dtype=np.float64)).view(np.uint64)


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(np.array_equal(bits(a), bits(b)))


def make_case(case):
    """(cfg, params, tokens, prompt_len, steps) of a case. Not named ``setup``: pytest 8.0 calls a module-level
    ``setup`` as the module's setup function."""
    seed, n_layer, n_head, d, prompt_len, steps = case
    cfg = ModelConfig(vocab=17, d_model=d, n_head=n_head, n_layer=n_layer, d_ff=2 * d, max_pos=24)
    params = init_params(cfg, seed)
    rng = np.random.default_rng(seed + 100)
    tokens = rng.integers(0, cfg.vocab, size=prompt_len + steps)
    return cfg, params, tokens, prompt_len, steps


def case_id(case) -> str:
    seed, n_layer, n_head, d, prompt_len, steps = case
    return f"s{seed}-L{n_layer}-H{n_head}-d{d}-P{prompt_len}"


numerics_grid = pytest.mark.parametrize(
    "nx", [Numerics.preset(p, order=o) for p in PRESETS for o in ORDERS], ids=lambda nx: nx.name
)
case_grid = pytest.mark.parametrize("case", CASES, ids=case_id)


def max_abs_change_per_layer(a: np.ndarray, b: np.ndarray, upto: int) -> list[float]:
    """Per layer (axis 0), the largest |a - b| over the first ``upto`` positions."""
    return [float(np.max(np.abs(a[layer, :upto] - b[layer, :upto]))) for layer in range(a.shape[0])]


# --- append invariance -------------------------------------------------------------------------


@numerics_grid
@case_grid
def test_append_invariance(nx, case):
    """Appending tokens changes no earlier position's residual stream, K or V at any layer:
    the maximum absolute change per layer is exactly 0.0 (and the bits are identical)."""
    cfg, params, tokens, T, _ = make_case(case)
    short = forward_trace(cfg, params, tokens[:T], nx)
    for extra in (1, 3):
        longer = forward_trace(cfg, params, tokens[: T + extra], nx)
        for key in ("resid", "k", "v"):
            changes = max_abs_change_per_layer(longer[key], short[key], T)
            assert changes == [0.0] * short[key].shape[0], (key, changes)
            assert same_bits(longer[key][:, :T], short[key])
        assert same_bits(longer["logits"][:T], short["logits"])


@numerics_grid
@pytest.mark.parametrize("case", [c for c in CASES if c[1] >= 2], ids=case_id)
def test_mask_off_exact_at_layer_1_and_moves_from_layer_2(nx, case):
    """Without the causal mask, layer 1's K and V of earlier positions still do not move
    (they depend on the embedding only), while every later layer's K and V change."""
    cfg, params, tokens, T, _ = make_case(case)
    short = forward_trace(cfg, params, tokens[:T], nx, causal=False)
    longer = forward_trace(cfg, params, tokens[: T + 1], nx, causal=False)
    for key in ("k", "v"):
        changes = max_abs_change_per_layer(longer[key], short[key], T)
        assert changes[0] == 0.0 and same_bits(longer[key][0, :T], short[key][0])
        assert all(c > 0.0 for c in changes[1:]), (key, changes)
    # the residual stream moves already after layer 1's attention
    resid = max_abs_change_per_layer(longer["resid"], short["resid"], T)
    assert resid[0] == 0.0 and all(c > 0.0 for c in resid[1:]), resid


# --- cache exactness -----------------------------------------------------------------------------


@numerics_grid
@case_grid
def test_generate_with_and_without_cache_identical(nx, case):
    cfg, params, tokens, P, steps = make_case(case)
    toks_c, logits_c = generate(cfg, params, tokens[:P], steps, nx, use_cache=True)
    toks_r, logits_r = generate(cfg, params, tokens[:P], steps, nx, use_cache=False)
    assert toks_c.shape == (steps,) and logits_c.shape == (steps, cfg.vocab)
    assert np.array_equal(toks_c, toks_r)
    for i in range(steps):
        assert same_bits(logits_c[i], logits_r[i]), f"step {i}"
    # greedy: each token is the argmax of its logits row
    assert np.array_equal(toks_c, np.argmax(logits_c, axis=1))


@numerics_grid
@case_grid
def test_decode_step_after_forward_equals_full_recompute(nx, case):
    cfg, params, tokens, P, steps = make_case(case)
    cache = KVCache.empty(cfg, nx, P + steps)
    prefill = forward(cfg, params, tokens[:P], nx, cache)
    assert cache.length == P
    assert same_bits(prefill, forward(cfg, params, tokens[:P], nx))
    # the prefill stored every position's K and V, exactly as the forward computes them
    trace = forward_trace(cfg, params, tokens[:P], nx)
    assert same_bits(cache.k[:, :P], trace["k"]) and same_bits(cache.v[:, :P], trace["v"])
    for pos in range(P, P + steps):
        row = decode_step(cfg, params, cache, int(tokens[pos]), pos, nx)
        full = forward(cfg, params, tokens[: pos + 1], nx)
        assert row.shape == (cfg.vocab,)
        assert same_bits(row, full[-1]), f"pos {pos}"
        assert cache.length == pos + 1
    trace = forward_trace(cfg, params, tokens[: P + steps], nx)
    assert same_bits(cache.k, trace["k"]) and same_bits(cache.v, trace["v"])


@numerics_grid
@case_grid
def test_chunked_prefill_equals_one_forward(nx, case):
    """forward() continuing a cache gives the same rows as one forward over everything."""
    cfg, params, tokens, P, steps = make_case(case)
    full = forward(cfg, params, tokens, nx)
    cache = KVCache.empty(cfg, nx)
    cut = max(1, P // 2)
    first = forward(cfg, params, tokens[:cut], nx, cache)
    rest = forward(cfg, params, tokens[cut:], nx, cache)
    assert cache.length == tokens.size
    assert same_bits(np.concatenate([first, rest]), full)


@pytest.mark.parametrize("bug", ["stale", "posoff", "kvswap", "noscale"])
def test_the_cache_comparison_catches_a_bug(bug):
    """Control: the same == comparison fails when the decode path has a one-line bug."""
    caught = 0
    for case in CASES:
        cfg, params, tokens, P, steps = make_case(case)
        _, logits_bug = generate(cfg, params, tokens[:P], steps, "f64", use_cache=True, bug=bug)
        _, logits_ref = generate(cfg, params, tokens[:P], steps, "f64", use_cache=False)
        assert same_bits(logits_bug[0], logits_ref[0])  # row 0 is the prefill's, before any decode
        caught += not same_bits(logits_bug[1:], logits_ref[1:])
    assert caught == len(CASES)


def test_orders_change_the_model_output():
    """The order knob reaches the model: the two orders give different logits (where the
    accumulator is fine enough for order to show), while each is cache-exact."""
    cfg, params, tokens, _, _ = make_case(CASES[2])
    for storage, accum in [("f64", "f64"), ("f32", "f32"), ("bf16", "bf16")]:
        seq = forward(cfg, params, tokens, Numerics(storage, accum, "sequential"))
        pair = forward(cfg, params, tokens, Numerics(storage, accum, "pairwise"))
        assert not same_bits(seq, pair), (storage, accum)


# --- save / load ---------------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path):
    cfg = ModelConfig(vocab=11, d_model=12, n_head=3, n_layer=2, d_ff=20, max_pos=9, eps=3e-6)
    params = init_params(cfg, 5)
    path = tmp_path / "model.npz"
    save_params(path, cfg, params)
    cfg2, params2 = load_params(path)
    assert cfg2 == cfg
    assert list(params2) == list(params)
    for name, arr in params.items():
        assert params2[name].dtype == np.float64 and same_bits(params2[name], arr), name
    # other tools can read it with plain NumPy: exactly the parameter names plus the config
    with np.load(path) as data:
        assert set(data.files) == set(params) | {"config"}
        assert same_bits(data["h1.w2"], params["h1.w2"])
    tokens = np.array([3, 1, 4, 1, 5])
    assert same_bits(forward(cfg2, params2, tokens, "bf16"), forward(cfg, params, tokens, "bf16"))


def test_init_params_names_shapes_and_determinism():
    cfg = ModelConfig(vocab=11, d_model=12, n_head=3, n_layer=2, d_ff=20, max_pos=9)
    p = init_params(cfg, 7)
    d, f = cfg.d_model, cfg.d_ff
    want = {"wte": (11, d), "wpe": (9, d), "gf": (d,), "w_out": (d, 11)}
    for layer in range(2):
        want |= {f"h{layer}.g1": (d,), f"h{layer}.g2": (d,), f"h{layer}.w1": (d, f), f"h{layer}.w2": (f, d)}
        want |= {f"h{layer}.{m}": (d, d) for m in ("wq", "wk", "wv", "wo")}
    assert {k: v.shape for k, v in p.items()} == want
    again = init_params(cfg, 7)
    assert all(same_bits(p[k], again[k]) for k in p)
    other = init_params(cfg, 8)
    assert not same_bits(p["wte"], other["wte"])


@numerics_grid
def test_generate_up_to_max_pos_with_and_without_cache(nx):
    """The longest generation allowed (prompt + steps - 1 == max_pos) works and is cache-exact."""
    cfg = ModelConfig(vocab=17, d_model=8, n_head=2, n_layer=2, d_ff=16, max_pos=9)
    params = init_params(cfg, 9)
    for P in (1, 4, 9):
        steps = cfg.max_pos - P + 1
        toks_c, logits_c = generate(cfg, params, np.arange(P) % cfg.vocab, steps, nx, use_cache=True)
        toks_r, logits_r = generate(cfg, params, np.arange(P) % cfg.vocab, steps, nx, use_cache=False)
        assert np.array_equal(toks_c, toks_r) and same_bits(logits_c, logits_r)


# --- the containers that join the forward, the decode kernel and the backward -------------------


def test_stacked_weights_hold_every_parameter_by_name():
    """Each parameter reaches the decode kernel under its own short name: ``h{l}.wq`` is ``stacked.wq[l]``."""
    from kvfast.model.transformer import StackedWeights, Weights

    cfg = ModelConfig(vocab=11, d_model=12, n_head=3, n_layer=3, d_ff=20, max_pos=9)
    params = init_params(cfg, 3)
    w = Weights.prepare(cfg, params, Numerics.preset("bf16"))
    assert {name.split(".")[-1] for name in params} == set(StackedWeights._fields)
    for name, arr in w.named.items():
        short = name.split(".")[-1]
        got = getattr(w.stacked, short)
        if name.startswith("h"):
            got = got[int(name.split(".")[0][1:])]
        assert same_bits(got, arr), name
        assert got.flags.c_contiguous


def test_tape_keeps_each_layer_by_name():
    """The backward's tape holds, per layer, the tensors the forward names (x, h, q, k, v, att, y, ...)."""
    from kvfast.model.transformer import Tape, Weights, forward_prepared

    cfg = ModelConfig(vocab=11, d_model=8, n_head=2, n_layer=2, d_ff=16, max_pos=9)
    params, nx = init_params(cfg, 4), Numerics.preset("f64")
    tokens = np.array([1, 5, 2, 7])
    tape = Tape()
    logits = forward_prepared(cfg, Weights.prepare(cfg, params, nx), tokens, nx, tape=tape)
    trace = forward_trace(cfg, params, tokens, nx)
    assert same_bits(logits, trace["logits"])
    assert len(tape.layers) == cfg.n_layer
    for layer, t in enumerate(tape.layers):
        assert same_bits(t.x, trace["resid"][layer])
        assert same_bits(t.k, trace["k"][layer]) and same_bits(t.v, trace["v"][layer])
        assert t.att.shape == (cfg.n_head, 4, 4)
    assert same_bits(tape.head.x, trace["resid"][-1])
    assert np.array_equal(tape.head.positions, np.arange(4))


def test_kv_cache_append_advance_truncate():
    cfg = ModelConfig(vocab=11, d_model=4, n_head=2, n_layer=2, d_ff=8, max_pos=9)
    cache = KVCache.empty(cfg, "f64", 6)
    rows = np.arange(12.0).reshape(3, 4)
    kbuf, vbuf = cache.append(1, rows, -rows)
    assert cache.length == 0  # append stores; advance moves the length
    assert same_bits(kbuf[:3], rows) and same_bits(vbuf[:3], -rows)
    assert same_bits(cache.k[1, :3], rows) and not cache.k[0].any()
    cache.advance(3, prefill=True)
    assert (cache.length, cache.prefill_len) == (3, 3)
    cache.append(0, rows[:1], rows[:1])
    assert same_bits(cache.k[0, 3], rows[0])
    cache.advance(1)
    assert (cache.length, cache.prefill_len) == (4, 3)
    cache.truncate(2)
    assert cache.length == 2
    with pytest.raises(ValueError, match=r"length: 3 is not allowed; allowed: an integer >= 0, <= 2"):
        cache.truncate(3)


# --- the public functions' cache of prepared weights -------------------------------------------


def test_public_functions_reuse_prepared_weights_and_never_serve_stale_ones():
    from kvfast.model.transformer import Weights

    cfg = ModelConfig(vocab=17, d_model=8, n_head=2, n_layer=2, d_ff=16, max_pos=24)
    params = init_params(cfg, 3)
    tokens = np.arange(6)
    nx = Numerics.preset("bf16")
    before = forward(cfg, params, tokens, nx)
    w = Weights.cached(cfg, params, nx)
    assert Weights.cached(cfg, params, nx) is w  # reused: no rounding per call
    assert all(not a.flags.writeable for a in params.values())  # frozen while cached
    with pytest.raises(ValueError, match="read-only"):
        params["h1.wq"] += 1.0  # an in-place update cannot go unseen: it is refused
    # updating in place after turning writing back on: the next call prepares afresh
    params["h1.wq"].flags.writeable = True
    params["h1.wq"] *= 2.0
    fresh = {k: v.copy() for k, v in params.items()}
    after = forward(cfg, params, tokens, nx)
    assert Weights.cached(cfg, params, nx) is not w
    assert same_bits(after, forward(cfg, fresh, tokens, nx))
    assert not same_bits(after, before)
    # a new array in the dict: prepared afresh
    params["gf"] = params["gf"] * 0.5
    copies = {k: v.copy() for k, v in params.items()}
    assert same_bits(forward(cfg, params, tokens, nx), forward(cfg, copies, tokens, nx))
    # views are never cached nor frozen (their owner could be written)
    owner = params["wte"].copy()
    params["wte"] = owner[:, :]
    first = forward(cfg, params, tokens, nx)
    assert params["wte"].flags.writeable and owner.flags.writeable
    owner[tokens] += 1.0
    assert not same_bits(forward(cfg, params, tokens, nx), first)
    # the same array objects in the same order under swapped names: prepared afresh, not served from the cache
    swapped = init_params(cfg, 4)
    a, b = swapped.pop("h0.w1"), swapped.pop("h1.w1")
    swapped = {"h1.w1": a, "h0.w1": b, **swapped}
    again = {"h0.w1": a, "h1.w1": b, **{k: v for k, v in swapped.items() if k not in ("h0.w1", "h1.w1")}}
    forward(cfg, again, tokens, nx)  # cached under the right names
    want = forward(cfg, {k: v.copy() for k, v in swapped.items()}, tokens, nx)
    assert same_bits(forward(cfg, swapped, tokens, nx), want)
    # decode_step and generate go through the same cache
    cache = KVCache.empty(cfg, nx)
    forward(cfg, params, tokens[:3], nx, cache)
    params["wte"] = owner  # owns its memory again
    row = decode_step(cfg, params, cache, int(tokens[3]), 3, nx)
    assert not params["wte"].flags.writeable
    assert same_bits(row, forward(cfg, {k: v.copy() for k, v in params.items()}, tokens[:4], nx)[-1])
