"""The exactness, bug and detector studies measure through kvfast.check: ``check_cache(...,
follow="cache", keep_logits=True)`` feeds the cache its own greedy tokens and keeps the logits, and a
study run's numbers equal an independent computation from ``generate`` and ``forward`` (the studies'
earlier method), compared with ``==``."""

from __future__ import annotations

import numpy as np
import pytest

from kvfast import ModelConfig, Numerics, forward, generate, init_params
from kvfast.check import KvfastModel, check_cache
from kvfast.model.bugs import BUGS
from kvfast.studies import bugs, exactness

CFG = ModelConfig(vocab=32, d_model=16, n_head=2, n_layer=2, d_ff=32, max_pos=48)
PROMPT = np.array([3, 1, 4, 1, 5, 9])
T = PROMPT.shape[0]
STEPS = 20  # decode steps; > EVICT_WINDOW - len(PROMPT): evict bites


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 0)


# --- check_cache(follow="cache", keep_logits=True) -----------------------------------------------


@pytest.mark.parametrize("bug", [None, *BUGS])
def test_follow_cache_feeds_the_caches_own_tokens_against_the_recompute_of_that_sequence(params, bug):
    nx = Numerics.preset("f64")
    report = check_cache(
        KvfastModel(CFG, params, nx, bug=bug), PROMPT, STEPS, scenarios="decode", follow="cache", keep_logits=True
    )
    s = report.scenarios["decode"]
    tokens, logits = generate(CFG, params, PROMPT, STEPS + 1, nx, use_cache=True, bug=bug)
    assert np.array_equal(s.tokens, tokens[:STEPS]) and np.array_equal(report.tokens, s.tokens)
    assert np.array_equal(s.cache_logits[T - 1 :], logits)
    ref = forward(CFG, params, np.concatenate([PROMPT, tokens[:STEPS]]), nx)
    assert np.array_equal(s.reference, ref)
    assert s.deviation[0] == np.abs(s.cache_logits[:T] - ref[:T]).max()
    assert np.array_equal(s.deviation[1:], np.abs(logits[1:] - ref[T:]).max(axis=1))
    assert report.path == "fast"
    slow = check_cache(
        KvfastModel(CFG, params, nx, bug=bug), PROMPT, STEPS, scenarios="decode", follow="cache", fast=False
    )
    assert slow.path == "per-step"
    per_step = slow.scenarios["decode"]
    assert np.array_equal(per_step.deviation, s.deviation) and np.array_equal(per_step.tokens, s.tokens)
    assert (report.verdict == "exact") == (bug is None)


def test_follow_cache_changes_the_text_where_a_bug_does(params):
    """posoff steers the generation: the cache's own tokens are not the recompute's, so the option matters."""
    model = KvfastModel(CFG, params, bug="posoff")
    own = check_cache(model, PROMPT, STEPS, scenarios="decode", follow="cache")
    default = check_cache(model, PROMPT, STEPS, scenarios="decode")
    assert not np.array_equal(own.tokens, default.tokens)
    assert own.first_divergent_step == default.first_divergent_step == 1


def test_follow_cache_runs_each_scenario_on_its_own_tokens(params):
    report = check_cache(KvfastModel(CFG, params, bug="posfrozen"), PROMPT, STEPS, follow="cache", keep_logits=True)
    for name, s in report.scenarios.items():
        assert np.array_equal(s.tokens, np.argmax(s.cache_logits[T - 1 : T - 1 + STEPS], axis=1)), name
    assert np.array_equal(report.tokens, report.scenarios["decode"].tokens)


def test_keep_logits_on_the_default_path_and_off_by_default(params):
    plain = check_cache(KvfastModel(CFG, params), PROMPT, 4)
    assert all(s.cache_logits is None and s.reference is None for s in plain.scenarios.values())
    kept = check_cache(KvfastModel(CFG, params, bug="stale"), PROMPT, 4, keep_logits=True)
    for s in kept.scenarios.values():
        assert np.array_equal(np.argmax(s.reference[T - 1 : T + 3], axis=1), kept.tokens)
        assert np.array_equal(np.abs(s.cache_logits - s.reference)[T:].max(axis=1), s.deviation[1:])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"follow": "bugged"}, "follow: 'bugged' is not allowed; allowed: recompute, cache"),
        ({"follow": "cache", "mode": "control"}, "follow: 'cache' is not allowed with mode='control'"),
        ({"keep_logits": 1}, "keep_logits: 1 is not allowed; allowed: True or False"),
    ],
)
def test_bad_follow_and_keep_logits(params, kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_cache(KvfastModel(CFG, params), PROMPT, 4, **kwargs)


# --- a study run equals the independent computation ----------------------------------------------


def old_bug_run(config: dict) -> dict:
    """The bug study's numbers from generate + one forward of the generated sequence (its former code)."""
    cfg, params = bugs.model_for(config)
    nx = Numerics.preset(config["preset"])
    prompt = bugs.prompt_for(config)

    def gen(bug):
        t, lg = generate(cfg, params, prompt, config["steps"], nx, use_cache=True, bug=bug)
        ref = forward(cfg, params, np.concatenate([prompt, t[:-1]]), nx)[prompt.shape[0] - 1 :]
        differ = np.nonzero((lg != ref).any(axis=1))[0]
        return t, lg, np.abs(lg - ref).max(axis=1), int(differ[0]) if differ.size else -1

    ct, cl, cdev, cfirst = gen(None)
    bt, _, dev, first = (ct, cl, cdev, cfirst) if config["bug"] == "none" else gen(config["bug"])
    changed = np.nonzero(bt != ct)[0]
    top2 = np.sort(cl, axis=1)[:, -2:]
    return {
        "dev_step1": float(dev[1]),
        "dev_all": float(dev.max()),
        "dev_per_step": [float(x) for x in dev],
        "first_bad_step": first,
        "tokens_changed": bool(changed.size),
        "first_changed_token": int(changed[0]) if changed.size else -1,
        "clean_dev": float(cdev.max()),
        "clean_margin_min": float((top2[:, 1] - top2[:, 0]).min()),
        "tokens": ",".join(map(str, bt)),
        "clean_tokens": ",".join(map(str, ct)),
    }


@pytest.mark.parametrize("bug", [*BUGS, "none"])
def test_bug_study_run_equals_generate_and_forward(bug):
    for seed, n_layer, n_head, prompt_len in ((0, 1, 2, 4), (1, 2, 1, 13)):
        config = {
            "bug": bug, "model": "random", "seed": seed, "n_layer": n_layer, "n_head": n_head, "d_model": 16,
            "d_ff": 32, "vocab": 32, "prompt_len": prompt_len, "steps": 16, "preset": "f64",
        }  # fmt: skip
        assert bugs.run(config) == old_bug_run(config), config


@pytest.mark.parametrize("preset", ["f64", "f32", "bf16"])
def test_exactness_run_equals_two_independent_generations(preset):
    for order, prompt_len, steps in (("sequential", 1, 1), ("pairwise", 3, 2), ("sequential", 6, 8)):
        config = {
            "seed": 1, "n_layer": 2, "n_head": 2, "d_model": 16, "d_ff": 32, "vocab": 32,
            "prompt_len": prompt_len, "steps": steps, "order": order, "preset": preset,
        }  # fmt: skip
        cfg, params = exactness.model_for(config)
        nx = Numerics.preset(preset, order)
        prompt = exactness.prompt_for(config)
        tc, lc = generate(cfg, params, prompt, steps, nx, use_cache=True)
        tf, lf = generate(cfg, params, prompt, steps, nx, use_cache=False)
        bad = np.nonzero((lc != lf).any(axis=1))[0]
        expect = {
            "storage": nx.storage,
            "accum": nx.accum,
            "max_abs_dev": float(np.abs(lc - lf).max()),
            "first_bad_step": int(bad[0]) if bad.size else -1,
            "tokens_equal": bool((tc == tf).all()),
            "tokens": ",".join(map(str, tc)),
        }
        assert exactness.run(config) == expect, config
