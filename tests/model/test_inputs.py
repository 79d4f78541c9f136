"""Bad input: every public function validates before computing and raises ValueError naming
the field, the value and what is allowed, and leaves a cache it was given untouched."""

from __future__ import annotations

import re

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
    loss_and_grads,
    save_params,
)

SIZES = dict(vocab=7, d_model=8, n_head=2, n_layer=2, d_ff=12, max_pos=6)
CFG = ModelConfig(**SIZES)
PARAMS = init_params(CFG, 0)
NX = Numerics()


def raises(fn, field: str, value: str):
    """``fn()`` raises ValueError whose message starts with ``field:``, shows ``value`` and says
    what is allowed."""
    with pytest.raises(ValueError) as info:
        fn()
    msg = str(info.value)
    assert msg.startswith(f"{field}:"), msg
    assert value in msg, msg
    assert "allowed" in msg, msg
    return msg


def filled_cache(n: int, capacity: int | None = None, numerics=NX) -> KVCache:
    cache = KVCache.empty(CFG, numerics, capacity)
    forward(CFG, PARAMS, np.arange(n) % CFG.vocab, numerics, cache)
    return cache


# --- ModelConfig ----------------------------------------------------------------------------------


def test_d_model_not_divisible_by_n_head():
    msg = raises(lambda: ModelConfig(**{**SIZES, "d_model": 10, "n_head": 3}), "d_model", "10")
    assert "n_head=3" in msg


@pytest.mark.parametrize("field", list(SIZES))
@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "4", None])
def test_non_positive_or_non_integer_sizes(field, bad):
    raises(lambda: ModelConfig(**{**SIZES, field: bad}), field, repr(bad))


@pytest.mark.parametrize("bad", [0.0, -1e-5, float("nan"), "1e-5"])
def test_bad_eps(bad):
    raises(lambda: ModelConfig(**SIZES, eps=bad), "eps", repr(bad))


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_seed(bad):
    raises(lambda: init_params(CFG, bad), "seed", repr(bad))


# --- Numerics names --------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["f16", "F64", "", 64])
def test_unknown_preset(bad):
    msg = raises(lambda: Numerics.preset(bad), "preset", repr(bad))
    assert "bf16, f32, f64" in msg


@pytest.mark.parametrize("field", ["storage", "accum"])
@pytest.mark.parametrize("bad", ["fp32", "float64", "f16", None])
def test_unknown_storage_or_accumulator(field, bad):
    msg = raises(lambda: Numerics(**{field: bad}), field, repr(bad))
    assert "bf16, f32, f64" in msg


@pytest.mark.parametrize("bad", ["left", "Sequential", "tree", 0])
def test_unknown_order(bad):
    msg = raises(lambda: Numerics(order=bad), "order", repr(bad))
    assert "pairwise, sequential" in msg
    raises(lambda: Numerics.preset("f64", order=bad), "order", repr(bad))


def test_unknown_preset_name_given_to_model_functions():
    raises(lambda: forward(CFG, PARAMS, [1, 2], "f8"), "preset", "'f8'")
    raises(lambda: generate(CFG, PARAMS, [1, 2], 2, "f8"), "preset", "'f8'")
    raises(lambda: KVCache.empty(CFG, "f8"), "preset", "'f8'")
    raises(lambda: forward(CFG, PARAMS, [1, 2], 3.5), "numerics", "3.5")


# --- tokens -----------------------------------------------------------------------------------------

TOKEN_FNS = {
    "forward": lambda toks: forward(CFG, PARAMS, toks, NX),
    "forward_trace": lambda toks: forward_trace(CFG, PARAMS, toks, NX),
    "loss_and_grads": lambda toks: loss_and_grads(CFG, PARAMS, toks, [0] * len(toks), NX),
}


@pytest.mark.parametrize("fn", list(TOKEN_FNS))
@pytest.mark.parametrize("bad", [-1, 7, 100])
def test_token_id_out_of_range(fn, bad):
    msg = raises(lambda: TOKEN_FNS[fn]([1, bad, 2]), "tokens", str(bad))
    assert "[0, 7)" in msg


@pytest.mark.parametrize("bad", [-1, 7])
def test_token_id_out_of_range_elsewhere(bad):
    raises(lambda: generate(CFG, PARAMS, [1, bad], 2, NX), "prompt", str(bad))
    raises(lambda: loss_and_grads(CFG, PARAMS, [1, 2], [0, bad], NX), "targets", str(bad))
    cache = filled_cache(2)
    raises(lambda: decode_step(CFG, PARAMS, cache, bad, 2, NX), "token", str(bad))


@pytest.mark.parametrize("fn", list(TOKEN_FNS))
@pytest.mark.parametrize(
    ("bad", "shown"),
    [
        ([1.0, 2.0], "float64"),
        (np.array([1, 2], dtype=np.float32), "float32"),
        (["a", "b"], "<U1"),
        ([True, False], "bool"),
        ([1, None], "object"),
        ([[1, 2]], "(1, 2)"),
        ([], "(0,)"),
    ],
)
def test_non_integer_tokens(fn, bad, shown):
    raises(lambda: TOKEN_FNS[fn](bad), "tokens", shown)


@pytest.mark.parametrize("bad", [1.0, "3", True, np.float64(2.0), None])
def test_non_integer_decode_token(bad):
    cache = filled_cache(2)
    raises(lambda: decode_step(CFG, PARAMS, cache, bad, 2, NX), "token", repr(bad))


# --- positions, prompt length, steps ------------------------------------------------------------------


def test_prompt_longer_than_max_pos():
    too_long = np.zeros(CFG.max_pos + 1, dtype=np.int64)
    msg = raises(lambda: generate(CFG, PARAMS, too_long, 1, NX), "prompt", str(CFG.max_pos + 1))
    assert f"max_pos={CFG.max_pos}" in msg
    raises(lambda: forward(CFG, PARAMS, too_long, NX), "tokens", str(CFG.max_pos + 1))


def test_steps_past_max_pos():
    # a prompt of max_pos - 1 leaves room for exactly 2 steps (the last token needs no position)
    prompt = np.zeros(CFG.max_pos - 1, dtype=np.int64)
    assert generate(CFG, PARAMS, prompt, 2, NX)[0].shape == (2,)
    raises(lambda: generate(CFG, PARAMS, prompt, 3, NX), "steps", "3")


@pytest.mark.parametrize("bad", [0, -1, 1.0, True])
def test_bad_steps(bad):
    raises(lambda: generate(CFG, PARAMS, [1], bad, NX), "steps", repr(bad))


def test_position_at_or_past_max_pos():
    cache = filled_cache(CFG.max_pos)
    for bad in (CFG.max_pos, CFG.max_pos + 5):
        raises(lambda bad=bad: decode_step(CFG, PARAMS, cache, 1, bad, NX), "pos", str(bad))
    # continuing a cache past max_pos through forward()
    cache = filled_cache(CFG.max_pos - 1)
    raises(lambda: forward(CFG, PARAMS, [1, 2], NX, cache), "tokens", "max_pos")


@pytest.mark.parametrize("bad", [-1, 1.0, "2", True])
def test_bad_position_type(bad):
    cache = filled_cache(2)
    raises(lambda: decode_step(CFG, PARAMS, cache, 1, bad, NX), "pos", repr(bad))


def test_position_not_the_next_one():
    cache = filled_cache(3)
    for bad in (2, 4):
        raises(lambda bad=bad: decode_step(CFG, PARAMS, cache, 1, bad, NX), "pos", str(bad))


# --- the cache ----------------------------------------------------------------------------------------


def test_cache_full():
    cache = filled_cache(3, capacity=3)
    msg = raises(lambda: decode_step(CFG, PARAMS, cache, 1, 3, NX), "cache", "3 of 3")
    assert "full" in msg
    cache = filled_cache(2, capacity=3)
    raises(lambda: forward(CFG, PARAMS, [1, 2], NX, cache), "cache", "2 of 3")


def test_cache_made_for_another_config():
    other = ModelConfig(**{**SIZES, "d_ff": 16})
    cache = KVCache.empty(other, NX)
    forward(other, init_params(other, 0), [1, 2], NX, cache)
    raises(lambda: decode_step(CFG, PARAMS, cache, 1, 2, NX), "cache", "d_ff=16")
    raises(lambda: forward(CFG, PARAMS, [1], NX, KVCache.empty(other, NX)), "cache", "d_ff=16")


def test_cache_made_for_another_storage_format():
    cache = filled_cache(2)
    raises(lambda: decode_step(CFG, PARAMS, cache, 1, 2, Numerics.preset("bf16")), "cache", "'bf16'")


def test_cache_empty_or_wrong_type():
    raises(lambda: decode_step(CFG, PARAMS, KVCache.empty(CFG, NX), 1, 0, NX), "cache", "empty")
    raises(lambda: decode_step(CFG, PARAMS, {"k": 0}, 1, 0, NX), "cache", "dict")
    raises(lambda: forward(CFG, PARAMS, [1], NX, cache=[1]), "cache", "list")
    raises(lambda: forward(CFG, PARAMS, [1], NX, KVCache.empty(CFG, NX), causal=False), "causal", "False")


@pytest.mark.parametrize("bad", [0, CFG.max_pos + 1, 2.0, True])
def test_cache_capacity(bad):
    raises(lambda: KVCache.empty(CFG, NX, bad), "capacity", repr(bad))


def test_config_of_wrong_type():
    raises(lambda: forward(dict(SIZES), PARAMS, [1], NX), "config", "dict")
    raises(lambda: KVCache.empty(dict(SIZES), NX), "config", "dict")


# --- parameters ---------------------------------------------------------------------------------------


def params_with(**changes):
    p = dict(PARAMS)
    for name, value in changes.items():
        if value is None:
            del p[name.replace("__", ".")]
        else:
            p[name.replace("__", ".")] = value
    return p


BAD_PARAMS = [
    (params_with(h1__wq=None), "params", "'h1.wq'"),  # missing
    ({**PARAMS, "h2.wq": PARAMS["h1.wq"]}, "params", "'h2.wq'"),  # unexpected
    ({**params_with(wte=None), "WTE": PARAMS["wte"]}, "params", "'WTE'"),  # renamed
    (params_with(wte=PARAMS["wte"].T.copy()), "params['wte']", "(8, 7)"),  # shape
    (params_with(h0__g1=np.ones((1, 8))), "params['h0.g1']", "(1, 8)"),
    (params_with(w_out=PARAMS["w_out"][:, :-1]), "params['w_out']", "(8, 6)"),
    (params_with(gf=np.ones(8, dtype=np.int64)), "params['gf']", "int64"),  # dtype
    (params_with(gf=np.ones(8, dtype=np.float16)), "params['gf']", "float16"),
    (params_with(gf=np.ones(8, dtype=np.complex128)), "params['gf']", "complex128"),
    (params_with(gf=[1.0] * 8), "params['gf']", "list"),
    ([("wte", PARAMS["wte"])], "params", "list"),
]


@pytest.mark.parametrize(("bad", "field", "shown"), BAD_PARAMS)
def test_parameters_of_wrong_name_shape_or_dtype(bad, field, shown, tmp_path):
    fns = [
        lambda: forward(CFG, bad, [1, 2], NX),
        lambda: forward_trace(CFG, bad, [1, 2], NX),
        lambda: generate(CFG, bad, [1, 2], 2, NX),
        lambda: loss_and_grads(CFG, bad, [1, 2], [2, 3], NX),
        lambda: decode_step(CFG, bad, filled_cache(2), 1, 2, NX),
        lambda: save_params(tmp_path / "m.npz", CFG, bad),
    ]
    for fn in fns:
        raises(fn, field, shown)


def test_load_params_validates(tmp_path):
    path = tmp_path / "bad.npz"
    np.savez(path, **params_with(h0__wk=None))
    raises(lambda: load_params(path), "path", str(path))
    save_params(tmp_path / "ok.npz", CFG, PARAMS)
    with np.load(tmp_path / "ok.npz") as data:
        arrays = {k: data[k] for k in data.files}
    arrays["h0.wk"] = arrays["h0.wk"][:4]
    np.savez(path, **arrays)
    raises(lambda: load_params(path), "params['h0.wk']", "(4, 8)")


def test_targets_shape_must_match_tokens():
    raises(lambda: loss_and_grads(CFG, PARAMS, [1, 2, 3], [1, 2], NX), "targets", "(2,)")


# --- validation happens before any computing -----------------------------------------------------------


def test_rejected_calls_leave_the_cache_untouched():
    cache = filled_cache(3, capacity=4)
    k, v, length = cache.k.copy(), cache.v.copy(), cache.length
    bad_calls = [
        lambda: decode_step(CFG, PARAMS, cache, 99, 3, NX),
        lambda: decode_step(CFG, PARAMS, cache, 1, 4, NX),
        lambda: decode_step(CFG, params_with(h0__wv=None), cache, 1, 3, NX),
        lambda: decode_step(CFG, PARAMS, cache, 1, 3, Numerics.preset("f32")),
        lambda: forward(CFG, PARAMS, [1, 2], NX, cache),
        lambda: forward(CFG, PARAMS, [1, -2], NX, cache),
        lambda: forward(CFG, params_with(gf=np.ones(3)), [1], NX, cache),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()
        assert cache.length == length
        assert np.array_equal(cache.k.view(np.uint64), k.view(np.uint64))
        assert np.array_equal(cache.v.view(np.uint64), v.view(np.uint64))


def test_every_message_names_a_field_first():
    """The messages share one shape: ``field: value ...; allowed: ...``."""
    with pytest.raises(ValueError) as info:
        ModelConfig(**{**SIZES, "vocab": -1})
    assert re.fullmatch(r"vocab: -1 is not allowed; allowed: .+", str(info.value))
