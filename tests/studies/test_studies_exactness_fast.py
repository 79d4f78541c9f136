"""The per-run shortcuts of the exactness study and of the checker's hot path (issue 30): each one gives what the
long way gives, bit for bit, and each criterion has data that makes it fail."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvfast.check import KvfastModel, ModelUnderTestError, check_cache
from kvfast.check.adapters import prepared_weights
from kvfast.check.protocol import check_logits, logits_format, read_attribute
from kvfast.model.config import ModelConfig, init_params, param_shapes
from kvfast.model.transformer import Weights
from kvfast.numerics import Numerics
from kvfast.studies import exactness

CONFIG = {
    "seed": 1, "vocab": 32, "d_model": 16, "n_head": 2, "n_layer": 2, "d_ff": 32, "prompt_len": 3, "steps": 5,
    "order": "sequential", "preset": "f64",
}  # fmt: skip


def _same_params(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_init_params_does_not_depend_on_n_head_but_on_every_shape_and_the_seed():
    """What lets the study share one parameter set across head counts (exactness.model_for)."""
    cfg = ModelConfig(32, 16, 1, 2, 32, 8)
    base = init_params(cfg, 0)
    for n_head in (2, 4, 8, 16):
        other = ModelConfig(32, 16, n_head, 2, 32, 8)
        assert _same_params(init_params(other, 0), base)
    # control: what the parameters do depend on changes them
    assert not _same_params(init_params(cfg, 1), base)
    longer = init_params(ModelConfig(32, 16, 1, 2, 32, 9), 0)
    assert not np.array_equal(longer["h0.wq"], base["h0.wq"])


def _drawn_one_by_one(config: ModelConfig, seed: int, positions_last: bool = False) -> dict:
    """The parameters as init_params drew them before issue 30: one draw call per parameter, in order (with
    ``positions_last``, wpe's draw moved to the end)."""
    rng = np.random.default_rng(seed)
    names = list(param_shapes(config))
    if positions_last:
        names = [n for n in names if n != "wpe"] + ["wpe"]
    params = {}
    for name in names:
        shape = param_shapes(config)[name]
        short = name.split(".")[-1]
        if short in ("g1", "g2", "gf"):
            params[name] = np.ones(shape)
        elif short in ("wte", "wpe"):
            params[name] = rng.standard_normal(shape)
        else:
            params[name] = rng.standard_normal(shape) / np.sqrt(shape[0])
    return {name: params[name] for name in param_shapes(config)}


def _same_bits(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes() for k in a
    )


CONFIGS = [ModelConfig(32, 16, 1, n_layer, 32, max_pos) for n_layer in (1, 3) for max_pos in (26, 4, 11)] + [
    ModelConfig(7, 12, 3, 2, 5, 3),
    ModelConfig(64, 24, 2, 4, 40, 17),
]


@pytest.mark.parametrize("seed", [0, 5])
@pytest.mark.parametrize("positions_last", [False, True])
def test_init_params_cuts_the_same_bits_as_one_draw_per_parameter(seed, positions_last):
    """One draw for every parameter (init_params, in either layout): the bits of one draw call per parameter,
    each array its own."""
    for config in CONFIGS:
        got = init_params(config, seed, positions_last)
        assert _same_bits(got, _drawn_one_by_one(config, seed, positions_last))
        assert all(a.base is None for a in got.values())  # no view of the draws
    # control: the comparison sees one ulp, another seed, and the other layout
    config = CONFIGS[0]
    nudged = _drawn_one_by_one(config, seed, positions_last)
    nudged["h0.wk"][1, 2] = np.nextafter(nudged["h0.wk"][1, 2], np.inf)
    assert not _same_bits(init_params(config, seed, positions_last), nudged)
    want = _drawn_one_by_one(config, seed, positions_last)
    assert not _same_bits(init_params(config, seed + 1, positions_last), want)
    assert not _same_bits(init_params(config, seed, not positions_last), want)


def test_positions_last_makes_every_weight_independent_of_max_pos():
    """What lets the exactness study run every length on one model: with positions_last, a longer model's
    parameters are a shorter one's, wpe extended by rows; without it (control), every matrix changes."""
    short, long = (init_params(ModelConfig(32, 16, 2, 2, 32, m), 3, positions_last=True) for m in (8, 26))
    assert all(np.array_equal(short[k], long[k]) for k in short if k != "wpe")
    assert np.array_equal(long["wpe"][:8], short["wpe"]) and long["wpe"].shape == (26, 16)
    short, long = (init_params(ModelConfig(32, 16, 2, 2, 32, m), 3) for m in (8, 26))
    assert not np.array_equal(short["h0.wq"], long["h0.wq"]) and not np.array_equal(short["w_out"], long["w_out"])


def _frozen(params: dict) -> dict:
    for a in params.values():
        a.flags.writeable = False
    return params


def test_prepared_weights_are_reused_for_read_only_parameters_across_head_counts_and_orders():
    config = ModelConfig(32, 16, 2, 2, 32, 8)
    params = _frozen(init_params(config, 4))
    first = KvfastModel(config, params, "f64").weights
    for other in (ModelConfig(32, 16, 4, 2, 32, 8), ModelConfig(32, 16, 2, 2, 32, 8, eps=1e-6)):
        assert KvfastModel(other, params, "f64").weights is first
    assert KvfastModel(config, params, Numerics.preset("f64", "pairwise")).weights is first
    fresh = Weights.prepare(config, params, Numerics.preset("f64"))
    assert all(a.tobytes() == b.tobytes() for a, b in zip(first.stacked, fresh.stacked, strict=True))
    # control: another storage, other arrays of the same values, or a differently shaped config prepare anew
    assert KvfastModel(config, params, "f32").weights is not first
    copies = _frozen({k: v.copy() for k, v in params.items()})
    assert KvfastModel(config, copies, "f64").weights is not first


def test_writable_or_view_parameters_are_prepared_every_time_and_never_frozen():
    config = ModelConfig(32, 16, 2, 2, 32, 8)
    params = init_params(config, 4)
    a, b = KvfastModel(config, params, "f64"), KvfastModel(config, params, "f64")
    assert a.weights is not b.weights
    assert all(v.flags.writeable for v in params.values())  # the caller's arrays are left as they were
    params["h0.wq"] += 1.0  # so an update in place reaches the next model
    assert not np.array_equal(KvfastModel(config, params, "f64").weights.named["h0.wq"], a.weights.named["h0.wq"])
    views = _frozen({k: v[...] for k, v in init_params(config, 4).items()})  # read-only views: their owner is not
    assert prepared_weights(config, views, Numerics.preset("f64")) is not prepared_weights(
        config, views, Numerics.preset("f64")
    )


@pytest.mark.parametrize("n_head", [1, 2, 4])
def test_model_for_gives_the_params_init_params_draws(n_head):
    config = {**CONFIG, "n_head": n_head}
    cfg, params = exactness.model_for(config)
    assert cfg.n_head == n_head and cfg.max_pos == exactness.MIN_POSITIONS
    assert _same_params(params, init_params(cfg, config["seed"], positions_last=True))
    assert not _same_params(params, init_params(cfg, config["seed"] + 1, positions_last=True))  # control: seed
    # one parameter set for every length and head count of a seed and shape
    for other in ({"steps": 16}, {"prompt_len": 10, "n_head": 1}):
        assert exactness.model_for({**config, **other})[1] is params
    assert exactness.model_for({**config, "n_layer": 3})[1] is not params  # control: another shape


def test_positions_hold_the_run_in_a_power_of_two():
    assert [exactness.positions(n) for n in (1, 26, 32, 33, 64, 65, 1000)] == [32, 32, 32, 64, 64, 128, 1024]
    cfg, params = exactness.model_for({**CONFIG, "prompt_len": 30, "steps": 5})
    assert cfg.max_pos == 64 and params["wpe"].shape == (64, CONFIG["d_model"])
    short = exactness.model_for(CONFIG)[1]
    assert all(np.array_equal(short[k], params[k]) for k in short if k != "wpe")
    assert np.array_equal(params["wpe"][:32], short["wpe"])


def test_prompt_for_is_the_seeded_draw_and_read_only():
    prompt = exactness.prompt_for(CONFIG)
    rng = np.random.default_rng([CONFIG["seed"], CONFIG["prompt_len"], 7])
    drawn = rng.integers(0, CONFIG["vocab"], size=CONFIG["prompt_len"]).astype(np.int64)
    assert prompt.dtype == np.int64 and prompt.tolist() == drawn.tolist()
    assert exactness.prompt_for({**CONFIG, "seed": 2}).tolist() != drawn.tolist()  # control
    with pytest.raises(ValueError, match="read-only"):
        prompt[0] = 0


@pytest.mark.parametrize("n_head", [1, 2])
def test_a_run_equals_the_check_of_a_freshly_built_model(n_head):
    """The study's run (shared parameters, shared prompt, ``max_pos`` a power of two) against everything built anew
    for it (``max_pos`` the run's length: the rows past it change nothing)."""
    config = {**CONFIG, "n_head": n_head}
    row = exactness.run(config)
    cfg = ModelConfig(32, 16, n_head, 2, 32, config["prompt_len"] + config["steps"])
    rng = np.random.default_rng([config["seed"], config["prompt_len"], 7])
    prompt = rng.integers(0, 32, size=config["prompt_len"]).astype(np.int64)
    params = init_params(cfg, config["seed"], positions_last=True)
    report = check_cache(
        KvfastModel(cfg, params, "f64"), prompt, config["steps"] - 1, scenarios="decode", follow="cache",
        keep_logits=True,
    ).scenarios["decode"]  # fmt: skip
    tokens = np.argmax(report.cache_logits[config["prompt_len"] - 1 :], axis=1)
    assert row["tokens"] == ",".join(map(str, tokens))
    assert row["max_abs_dev"] == float(report.deviation.max()) == 0.0
    other = KvfastModel(cfg, init_params(cfg, config["seed"]), "f64")  # control: version 1's model's tokens differ
    shown = check_cache(other, prompt, config["steps"] - 1, scenarios="decode", follow="cache").scenarios["decode"]
    assert ",".join(map(str, shown.tokens)) != ",".join(map(str, tokens[1:]))


def test_check_logits_rejects_a_non_finite_value_and_keeps_every_finite_one():
    big = np.array([1e308, 1e308, -5.0])  # finite (their sum is not)
    out = check_logits(big, "decode", None, 3)
    assert out.tolist() == big.tolist() and out is not big
    for bad, index in ((np.array([1.0, np.nan, 2.0]), 1), (np.array([1.0, 2.0, -np.inf]), 2)):
        with pytest.raises(ValueError, match=rf"^model.decode at step 3: logits hold .* at index \({index},\); "):
            check_logits(bad, "decode", None, 3, "at step 3")
    ints = check_logits(np.array([[1, 2]], dtype=np.int32), "recompute", 1, 2)
    assert ints.dtype == np.float64 and ints.tolist() == [[1.0, 2.0]]


@pytest.mark.parametrize(
    "value, fmt",
    [
        (np.zeros(2, np.float16), "float16"), (np.zeros(2, np.float32), "float32"), (np.zeros(2), "float64"),
        (np.zeros(2, np.int64), "float64"), (np.zeros(2, ">f4"), "float64"), ([0.0, 1.0], "float64"),
        (torch.zeros(2, dtype=torch.bfloat16), "bfloat16"), (torch.zeros(2, dtype=torch.float32), "float32"),
    ],
)  # fmt: skip
def test_logits_format_reads_numpy_and_torch_dtypes(value, fmt):
    assert logits_format(value) == fmt


class RaisingDeclaration:
    """A model whose declaration raises when read (its property is the model's code)."""

    vocab_size = 4

    def recompute(self, tokens):
        return np.zeros((len(tokens), 4))

    prefill = recompute

    def decode(self, token):
        return np.zeros(4)

    @property
    def internal_formats(self):
        raise RuntimeError("no formats here")

    @property
    def lossy_cache(self):
        raise AttributeError("absent, as getattr reads it")


def test_a_declaration_that_raises_is_the_models_failure_and_an_attribute_error_reads_as_absent():
    model = RaisingDeclaration()
    assert read_attribute(model, "lossy_cache", "default") == "default"
    with pytest.raises(ModelUnderTestError) as info:
        read_attribute(model, "internal_formats")
    assert str(info.value) == "model.internal_formats raised RuntimeError: no formats here"
    assert type(info.value.__cause__) is RuntimeError
    with pytest.raises(ModelUnderTestError, match="^model.internal_formats raised RuntimeError"):
        check_cache(model, [0, 1], 2)
