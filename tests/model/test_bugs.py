"""The bug catalogue: each bug's signature on the real cached path, against a full recompute.

Fixed scenario: a random 2-layer, 2-head model, a prompt of PROMPT tokens,
STEPS greedy tokens (STEPS - 1 decode steps). For every bug: whether step 1
deviates (exactly 0.0 or not), and the first step whose logits differ at all,
which follows from the bug's one changed line:

- visible at step 1 (stale, posoff, kvswap, noscale): step 1;
- the growth bugs freeze, posfrozen, maskfrozen: step 2 (the first step at
  which the cache holds a decoded entry / the position passes the prompt);
- evict: the first step at which the cache plus the new token exceed the
  window, ``EVICT_WINDOW + 1 - PROMPT``.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvfast
from kvfast.model.bugs import BUG_CODES, BUGS, EVICT_WINDOW, VISIBLE_AT_STEP_1, bug_code

PROMPT = 5
STEPS = 20

EXPECTED_FIRST_BAD = {
    "stale": 1,
    "posoff": 1,
    "kvswap": 1,
    "noscale": 1,
    "freeze": 2,
    "posfrozen": 2,
    "maskfrozen": 2,
    "evict": EVICT_WINDOW + 1 - PROMPT,
}


@pytest.fixture(scope="module")
def scenario():
    cfg = kvfast.ModelConfig(vocab=32, d_model=16, n_head=2, n_layer=2, d_ff=32, max_pos=PROMPT + STEPS)
    params = kvfast.init_params(cfg, 3)
    prompt = np.random.default_rng(3).integers(0, cfg.vocab, size=PROMPT)
    return cfg, params, prompt


def deviations(cfg, params, prompt, numerics, bug):
    """Per-step max abs deviation of the (bugged) cached run from a recompute of the same sequence,
    and the step-wise "differs at all" mask."""
    tokens, logits = kvfast.generate(cfg, params, prompt, STEPS, numerics, use_cache=True, bug=bug)
    seq = np.concatenate([prompt, tokens[:-1]])
    ref = np.stack([kvfast.forward(cfg, params, seq[: PROMPT + i], numerics)[-1] for i in range(STEPS)])
    return np.abs(logits - ref).max(axis=1), (logits != ref).any(axis=1)


def test_catalogue_has_eight_bugs_four_invisible_at_step_1():
    assert len(BUGS) == 8
    assert set(BUGS) == set(BUG_CODES) == set(VISIBLE_AT_STEP_1) == set(EXPECTED_FIRST_BAD)
    assert {"stale", "posoff", "freeze", "evict", "posfrozen"} <= set(BUGS)
    assert sum(VISIBLE_AT_STEP_1.values()) == 4
    assert [b for b, v in VISIBLE_AT_STEP_1.items() if not v] == ["freeze", "evict", "posfrozen", "maskfrozen"]
    assert len(set(BUG_CODES.values())) == 8 and 0 not in BUG_CODES.values()
    assert kvfast.BUGS is BUGS


@pytest.mark.parametrize("preset", ["f64", "f32", "bf16"])
def test_clean_path_is_exact_at_every_step(scenario, preset):
    cfg, params, prompt = scenario
    dev, differ = deviations(cfg, params, prompt, preset, None)
    assert not differ.any()
    assert dev.max() == 0.0


@pytest.mark.parametrize("preset", ["f64", "f32", "bf16"])
@pytest.mark.parametrize("bug", list(EXPECTED_FIRST_BAD))
def test_bug_signature(scenario, bug, preset):
    cfg, params, prompt = scenario
    dev, differ = deviations(cfg, params, prompt, preset, bug)
    # The prefill row is never touched by a decode bug.
    assert dev[0] == 0.0
    if VISIBLE_AT_STEP_1[bug]:
        assert dev[1] > 0.0
    else:
        assert dev[1] == 0.0
        assert not differ[1]
    first = int(np.nonzero(differ)[0][0])
    assert first == EXPECTED_FIRST_BAD[bug]
    assert (dev[:first] == 0.0).all()
    assert dev[first] > 0.0


@pytest.mark.parametrize("bug", list(BUGS))
def test_decode_step_takes_the_bug_by_name(scenario, bug):
    """One decode step after a prefill: only the step-1-visible bugs move the logits."""
    cfg, params, prompt = scenario
    nx = kvfast.Numerics()
    token = 7
    ref = kvfast.forward(cfg, params, np.append(prompt, token), nx)[-1]
    cache = kvfast.KVCache.empty(cfg, nx)
    kvfast.forward(cfg, params, prompt, nx, cache)
    got = kvfast.decode_step(cfg, params, cache, token, PROMPT, nx, bug=bug)
    assert (got != ref).any() == VISIBLE_AT_STEP_1[bug]
    # freeze first bites on the next step: the cache still grew by one here.
    assert cache.length == PROMPT + 1


def test_evict_first_bites_at_the_window(scenario):
    """evict's first bad step moves with the prompt length: the window is counted in cache entries."""
    cfg, params, _ = scenario
    for prompt_len in (2, 9, 15):
        prompt = np.arange(prompt_len) % cfg.vocab
        steps = EVICT_WINDOW + 3 - prompt_len
        tokens, logits = kvfast.generate(cfg, params, prompt, steps, "f64", bug="evict")
        seq = np.concatenate([prompt, tokens[:-1]])
        ref = kvfast.forward(cfg, params, seq, "f64")[prompt_len - 1 :]
        first = int(np.nonzero((logits != ref).any(axis=1))[0][0])
        assert first == EVICT_WINDOW + 1 - prompt_len


@pytest.mark.parametrize("bad", ["Stale", "", "none", 3, True])
def test_unknown_bug_is_a_value_error(bad):
    with pytest.raises(ValueError, match="bug: .* is not allowed; allowed: None, stale"):
        bug_code(bad)


def test_bug_needs_the_cache(scenario):
    cfg, params, prompt = scenario
    with pytest.raises(ValueError, match="use_cache=True"):
        kvfast.generate(cfg, params, prompt, 3, "f64", use_cache=False, bug="stale")
