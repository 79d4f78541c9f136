"""Hugging Face models checked out of the box (kvfast.check.hf): tiny random models from configs, no downloads.

The clean matrix (Llama, GPT-2, Mistral with a sliding window, Qwen2; float32, float64, bfloat16; sdpa and
eager; two seeds x two prompts, a given continuation and a greedy run) never gets a "bug" verdict in control
mode. Every injected logic bug is "bug" in float32 and float64, and in the float64 logic check of bfloat16
models, at the step where it first acts (kvfast.bugs.hf.first_acting_step states it per bug and scenario:
window at max(1, 8 - len(prompt) + 1), posoff at 1, freeze at 2, restart at 1 and replay at 0 in the resume
scenario only; the float16 round trip, a precision bug, at 1 (decode) and 0 (resume)).
The default run holds a pairwise share of the two matrix tests (every pair of values of any two axes; the
other cells are ``-m slow``). The full matrix with its rates: the ``hf_matrix`` study (``kvfast study hf_matrix``).
"""

from __future__ import annotations

import copy
import inspect
import itertools
import os

import numpy as np
import pytest

if os.environ.get("KVFAST_REQUIRE_HF") == "1":  # CI (.ci/run): run these, never skip them
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

from kvfast.bugs.hf import HF_BUGS, HF_LOGIC_BUGS, first_acting_step, inject_hf_bug  # noqa: E402
from kvfast.check import ModelUnderTestError, check_cache  # noqa: E402
from kvfast.check.hf import HFModel  # noqa: E402
from kvfast.studies.hf_common import prompt_and_continuation  # noqa: E402
from kvfast.studies.hf_matrix import PROMPT_LENGTHS, PROMPT_STREAM  # noqa: E402
from kvfast.testing import ATTENTION, DTYPES, FAMILIES, MISTRAL_WINDOW, TINY_VOCAB, tiny_model  # noqa: E402

STEPS = 16
# (seed, prompt id, prompt of 4 or 5 tokens, continuation): the hf_matrix study's first two prompts per seed
CASES = [
    (seed, k, *prompt_and_continuation(PROMPT_STREAM, seed, k, STEPS, PROMPT_LENGTHS))
    for seed in range(2)
    for k in range(2)
]


CASE_IDS = ("seed0-prompt5", "seed1-prompt4")  # CASES[1] and CASES[2]: a 5-token and a 4-token prompt


def in_default_run(family: str, dtype: str, attention: str, case: str | None = None) -> bool:
    """The matrix's share in the default run: every family x dtype once, the attention (and the bug test's
    case) alternating so that every pair of values of any two axes is in it (a pairwise covering set, 12 of
    24 clean and 12 of 48 bug cells); the other cells are ``-m slow``, the whole matrix again with its rates
    in ``test_the_measured_matrix``."""
    f, d = FAMILIES.index(family), DTYPES.index(dtype)
    fast = ATTENTION[(f + d) % 2] == attention
    return fast and (case is None or CASE_IDS[(f + d // 2) % 2] == case)


def matrix(*axes: tuple[str, ...]) -> list:
    """The cells of ``FAMILIES x DTYPES x ATTENTION (x axes)``, those outside :func:`in_default_run` marked slow."""
    cells = itertools.product(FAMILIES, DTYPES, ATTENTION, *axes)
    return [cell if in_default_run(*cell) else pytest.param(*cell, marks=pytest.mark.slow) for cell in cells]


def missing_pairs(cells: list, axes: tuple[tuple[str, ...], ...]) -> set:
    """The pairs of values of two axes (``(i, j, value_i, value_j)``) that no cell holds."""
    pairs = itertools.combinations(range(len(axes)), 2)
    every = {(i, j, a, b) for i, j in pairs for a, b in itertools.product(axes[i], axes[j])}
    return every - {(i, j, c[i], c[j]) for c in cells for i, j in itertools.combinations(range(len(axes)), 2)}


def test_the_default_run_holds_every_pair_of_values_of_the_matrix():
    for cells, axes in (
        (matrix(), (FAMILIES, DTYPES, ATTENTION)),
        (matrix(CASE_IDS), (FAMILIES, DTYPES, ATTENTION, CASE_IDS)),
    ):
        fast = [c for c in cells if not hasattr(c, "marks")]  # pytest.param(..., marks=slow) has marks
        assert len(fast) == len(FAMILIES) * len(DTYPES) < len(cells)
        assert missing_pairs(fast, axes) == set()
        # failing data: without eager attention the share would miss every pair holding it
        assert (0, 2, "llama", "eager") in missing_pairs([c for c in fast if c[2] == "sdpa"], axes)


@pytest.mark.parametrize(("family", "dtype", "attention"), matrix())
def test_clean_models_are_never_a_bug(family, dtype, attention, hf_model):
    for seed, k, prompt, continuation in CASES:
        model = hf_model(family, dtype, attention, seed)
        runs = [check_cache(model, prompt, mode="control", continuation=continuation)]
        if k == 0:
            runs.append(check_cache(model, prompt, STEPS, mode="control"))  # greedy tokens
        for report in runs:
            assert report.verdict != "bug", report.format()
            assert np.isfinite(report.max_ratio)
            if dtype != "bfloat16":  # measured: every float32/float64 run is rounding
                assert report.verdict == "rounding", report.format()
            assert report.path == "fast"


def _assert_caught(report, bug: str, logic: bool) -> None:
    """Every scenario the bug acts in says "bug" at the step where it first acts (the logic check if asked)."""
    checked = report.promoted if logic else report
    assert checked.verdict == "bug", checked.format()
    T = report.prompt.shape[0]
    for name, s in checked.scenarios.items():
        want = first_acting_step(bug, name, T)
        if want is None:
            assert s.verdict == "rounding", (name, checked.format())
        else:
            assert s.first_bug_step == want, (name, checked.format())


@pytest.mark.parametrize(("family", "dtype", "attention", "case"), matrix(CASE_IDS))
def test_every_bug_is_caught_at_the_step_where_it_first_acts(family, dtype, attention, case, hf_model):
    seed, _, prompt, continuation = CASES[1 + CASE_IDS.index(case)]
    model = hf_model(family, dtype, attention, seed)
    for bug in HF_BUGS:
        promote = "float64" if dtype != "float64" else None
        report = check_cache(
            inject_hf_bug(HFModel(model), bug), prompt, mode="control", continuation=continuation, promote=promote
        )
        assert not report.passed
        if dtype == "bfloat16":
            assert report.verdict in ("bug", "inconclusive", "rounding")  # native: often below bf16's resolution
            _assert_caught(report, bug, logic=True)
        elif bug in HF_LOGIC_BUGS or dtype == "float64":
            _assert_caught(report, bug, logic=False)
            if promote:
                _assert_caught(report, bug, logic=True)
        else:  # the float16 round trip in float32: a precision bug, found by the float64 logic check
            assert report.verdict in ("bug", "inconclusive")
            _assert_caught(report, bug, logic=True)


def test_bfloat16_recommends_the_logic_check_when_inconclusive(hf_model):
    model = hf_model("gpt2", "bfloat16", "sdpa", 0)
    seed, _, prompt, continuation = CASES[0]
    report = check_cache(inject_hf_bug(HFModel(model), "window"), prompt, mode="control", continuation=continuation)
    assert report.verdict == "inconclusive" and not report.passed
    assert any("promote='float64'" in n for n in report.notes)
    s = report.worst
    assert s.first_inconclusive_step is not None and "first inconclusive step" in report.format()
    logic = check_cache(
        inject_hf_bug(HFModel(model), "window"), prompt, mode="control", continuation=continuation, promote="float64"
    )
    assert logic.promoted.first_bug_step == first_acting_step("window", "decode", len(prompt))
    assert "logic check in float64 (same tokens): BUG" in logic.format()
    clean = check_cache(model, prompt, mode="control", continuation=continuation, promote="float64")
    assert clean.passed and clean.promoted.verdict == "rounding"


# --- the adapter ---------------------------------------------------------------------------------


def test_the_cache_argument_follows_the_forward_signature(hf_model):
    model = hf_model("llama", "float32", "sdpa", 0)
    # transformers 5.x names it cache (past_key_values is deprecated there), 4.x past_key_values
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    assert HFModel(model).cache_arg == name

    class OldApi(torch.nn.Module):
        """A 4.x-style forward: the cache comes in as past_key_values."""

        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, input_ids=None, past_key_values=None, attention_mask=None, use_cache=None):
            kwargs = {name: past_key_values, "attention_mask": attention_mask, "use_cache": use_cache}
            out = self.inner(input_ids=input_ids, **kwargs)
            return {"logits": out.logits, "past_key_values": out[name] if use_cache else None}

    old = HFModel(OldApi(model))
    assert old.cache_arg == "past_key_values"
    new = HFModel(model)
    prompt = np.array([5, 6, 7, 8])
    assert torch.equal(old.prefill(prompt), new.prefill(prompt))
    assert torch.equal(old.decode(9), new.decode(9))
    assert check_cache(old, prompt, 8, mode="control").verdict == "rounding"

    class TupleCache(OldApi):
        """Releases whose models take no cache object (4.3x GPT-2: tuples) say so; kvfast then passes None first."""

        _supports_cache_class = False

    tuples = HFModel(TupleCache(model))
    tuples.prefill(prompt)
    assert check_cache(tuples, prompt, 8, mode="control").verdict == "rounding"
    with pytest.raises(ValueError, match="bug: 'freeze' is not allowed; allowed: a bug the model's cache can take"):
        inject_hf_bug(HFModel(TupleCache(model)), "freeze").prefill(prompt)


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # nn.Linear and GPT-2's Conv1D
def test_variants_are_deep_copies_and_differ_only_in_order(family, hf_model):
    model = hf_model(family, "float32", "sdpa", 0)
    before = {name: p.detach().clone() for name, p in model.state_dict().items()}
    adapter = HFModel(model)
    tokens = np.arange(20) % TINY_VOCAB
    reference = adapter.recompute(tokens).numpy()
    variants = {k: v.numpy() for k, v in adapter.recompute_variants(tokens).items()}
    adapter.promote("float64").recompute_variants(tokens)
    assert set(variants) == {"attention", "batch", "rows"}
    # the model under test is untouched: still sdpa, no forward patched, the same weights, shared with no copy
    assert model.config._attn_implementation == "sdpa"
    assert adapter._copies["attention"].config._attn_implementation == "eager"
    assert adapter._copies["attention"].config is not model.config
    assert not any("forward" in vars(m) for m in model.modules())
    assert any("forward" in vars(m) for m in adapter._copies["rows"].modules())
    assert all(torch.equal(p, before[name]) for name, p in model.state_dict().items())
    assert next(model.parameters()).dtype == torch.float32
    ours = {p.data_ptr() for p in model.parameters()}
    for clone in adapter._copies.values():
        assert ours.isdisjoint(p.data_ptr() for p in clone.parameters())
    assert torch.equal(adapter.recompute(tokens), torch.from_numpy(reference))
    for name, v in variants.items():
        assert np.abs(v - reference).max() < 1e-5 * np.abs(reference).max(), name  # the same function
    assert any(not np.array_equal(v, reference) for v in variants.values())  # ... added up differently


def test_exact_mode_on_stock_models(hf_model):
    prompt = [3, 1, 4, 1, 5]
    # eager attention in bfloat16: the cache path is bit-identical to the recompute
    assert check_cache(hf_model("llama", "bfloat16", "eager"), prompt, 8, mode="exact").verdict == "exact"
    # sdpa in float32: order noise only, which exact mode flags and control mode calls rounding
    model = hf_model("llama", "float32", "sdpa")
    exact = check_cache(model, prompt, 8, mode="exact")
    assert exact.verdict == "divergent" and exact.max_deviation < 1e-5
    assert check_cache(model, prompt, 8, mode="control").verdict == "rounding"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_static_cache(family, hf_model):
    """A StaticCache (preallocated, updated in place) from new_cache: clean is rounding, bugs caught where they act."""
    model = hf_model(family, "float32", "sdpa", 0)
    adapter = HFModel(model, new_cache=lambda: transformers.StaticCache(config=model.config, max_cache_len=64))
    prompt = [1, 2, 3, 4, 5, 6]
    report = check_cache(adapter, prompt, 20, mode="control")
    assert report.verdict == "rounding", report.format()
    assert isinstance(adapter.cache, transformers.StaticCache)  # the check really ran on it
    for bug in ("posoff", "freeze", "replay"):  # first acts at decode step 1, 2, and resume step 0
        bugged = inject_hf_bug(
            HFModel(model, new_cache=lambda: transformers.StaticCache(config=model.config, max_cache_len=64)), bug
        )
        _assert_caught(check_cache(bugged, prompt, 20, mode="control"), bug, logic=False)


def test_a_sliding_window_model(hf_model):
    """Mistral with a sliding window of MISTRAL_WINDOW positions, crossed by 6 + 20: the window is real (the
    same weights without it give other logits there), and the check follows it with a DynamicCache and a
    StaticCache."""
    model = hf_model("mistral", "float32", "sdpa", 0)
    prompt, steps = [1, 2, 3, 4, 5, 6], 20
    assert model.config.sliding_window == MISTRAL_WINDOW < len(prompt) + steps
    tokens = np.arange(len(prompt) + steps) % TINY_VOCAB
    unwindowed = copy.deepcopy(model)
    unwindowed.config.sliding_window = None
    windowed, full = HFModel(model).recompute(tokens), HFModel(unwindowed).recompute(tokens)
    assert torch.equal(windowed[:MISTRAL_WINDOW], full[:MISTRAL_WINDOW])  # identical until the window is full
    assert not torch.equal(windowed[MISTRAL_WINDOW:], full[MISTRAL_WINDOW:])
    static = HFModel(model, new_cache=lambda: transformers.StaticCache(config=model.config, max_cache_len=64))
    for adapter in (HFModel(model), static):
        assert check_cache(adapter, prompt, steps, mode="control").verdict == "rounding"
        assert check_cache(adapter, prompt, steps, mode="control", promote="float64").promoted.verdict == "rounding"
    for bug in HF_LOGIC_BUGS:
        _assert_caught(check_cache(inject_hf_bug(HFModel(model), bug), prompt, steps, mode="control"), bug, logic=False)


def test_continuation_is_what_decode_is_fed(hf_model):
    model = hf_model("gpt2", "float32", "sdpa", 0)
    continuation = [9, 8, 7, 6, 5]
    report = check_cache(model, [1, 2, 3], mode="control", continuation=continuation)
    assert report.tokens.tolist() == continuation and report.steps == 5
    assert check_cache(model, [1, 2, 3], 3, continuation=continuation).tokens.tolist() == [9, 8, 7]
    with pytest.raises(ValueError, match="steps: 6 is not allowed; allowed: an integer >= 1, <= 5"):
        check_cache(model, [1, 2, 3], 6, continuation=continuation)
    with pytest.raises(ValueError, match="continuation: token 96 is out of range"):
        check_cache(model, [1, 2, 3], continuation=[1, 96])


def test_mis_wrapped_models_raise_clear_value_errors(hf_model):
    model = hf_model("llama", "float32", "sdpa", 0)
    with pytest.raises(ValueError, match="model: 'str' is not allowed; allowed: a transformers causal LM"):
        HFModel("llama")
    with pytest.raises(ValueError, match="it returned no logits"):
        check_cache(model.model, [1, 2, 3], 4)  # the base model, without its language-model head
    with pytest.raises(ValueError, match="has no method 'recompute'"):
        check_cache(torch.nn.Linear(2, 2), [1, 2, 3], 4)  # no config: neither a model under test nor HF
    with pytest.raises(ValueError, match=r"steps: 512 is not allowed; allowed: at most 510 \(the model has 512"):
        check_cache(model, [1, 2], 512)
    with pytest.raises(ValueError, match="positions: 513 is not allowed; allowed: at most 512 positions"):
        HFModel(model).recompute(np.zeros(513, dtype=np.int64))
    shrunk = tiny_model("llama", "float32", "sdpa", 0)
    shrunk.config.vocab_size = 200  # the config says 200 tokens, the embedding holds 96
    with pytest.raises(ModelUnderTestError, match=r"^model\.recompute\(<2 tokens>\) raised IndexError: "):
        check_cache(shrunk, [150, 2], 2)  # the model's own forward fails: the model's error, not bad input
    with pytest.raises(ValueError, match="cache: empty; allowed: call prefill"):
        HFModel(model).decode(1)
    with pytest.raises(ValueError, match="variants: 'flash' is not allowed"):
        HFModel(model, variants=("flash",))
    with pytest.raises(ValueError, match="promote: 'float16' is not allowed; allowed: float64"):
        check_cache(model, [1, 2], 2, promote="float16")
    with pytest.raises(ValueError, match="token: 96 is not allowed"):
        adapter = HFModel(model)
        adapter.prefill([1, 2])
        adapter.decode(96)


def test_promote_copies_the_model_and_keeps_the_bug(hf_model):
    model = hf_model("llama", "bfloat16", "sdpa", 0)
    adapter = inject_hf_bug(HFModel(model), "freeze")
    promoted = adapter.promote("float64")
    assert promoted.bug == "freeze" and promoted.dtype == "float64" and adapter.dtype == "bfloat16"
    assert next(model.parameters()).dtype == torch.bfloat16
    again = copy.deepcopy(model).to(torch.float64)
    assert torch.equal(promoted.recompute([1, 2, 3]), HFModel(again).recompute([1, 2, 3]))


def test_the_report_says_which_scenario_failed_first(hf_model):
    model = hf_model("llama", "float32", "sdpa", 0)
    report = check_cache(inject_hf_bug(HFModel(model), "replay"), [1, 2, 3, 4, 5, 6], 6, mode="control")
    text = report.format()
    assert report.scenarios["decode"].verdict == "rounding"
    assert report.scenarios["resume"].first_bug_step == 0
    assert "first in scenario 'resume', step 0 (the resumed chunk, prompt position 3-5, after a prefill of 0-2)" in text
    assert "decode: rounding" in text


# --- pytest and the command line --------------------------------------------------------------------


pytest_plugins = ["pytester"]


def test_kv_check_takes_a_hugging_face_model(pytester):
    pytester.makepyfile(
        test_hf="""
        import torch
        from kvfast.bugs.hf import inject_hf_bug
        from kvfast.check.hf import HFModel
        from kvfast.testing import tiny_model

        torch.set_num_threads(1)

        def test_clean(kv_check):
            report = kv_check(tiny_model("gpt2"), prompt=[1, 2, 3], steps=6, mode="control")
            assert report.verdict == "rounding"

        def test_posoff(kv_check):
            model = inject_hf_bug(HFModel(tiny_model("gpt2")), "posoff")
            kv_check(model, prompt=[1, 2, 3], continuation=[4, 5, 6], mode="control")
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    assert "first bug step 1 (position 3)" in result.stdout.str()


HF_BUGGED = (
    "from kvfast.bugs.hf import inject_hf_bug\nfrom kvfast.check.hf import HFModel\n"
    "from kvfast.testing import tiny_model\n\n"
    "def make(bug, dtype='float32', family='llama'):\n"
    "    return inject_hf_bug(HFModel(tiny_model(family, dtype)), bug)\n"
)


@pytest.mark.subprocess
def test_cli_checks_a_hugging_face_model(capsys, tmp_path, monkeypatch):
    """``kvfast check`` of a Hugging Face factory: the verdicts that need the child (a bug found by the float64
    logic check: exit 1; inconclusive: exit 3) through it, the other flags in this process through the child's
    own function (:func:`kvfast.commands.check.run_check`). Each flag through a real child:
    test_cli_checks_a_hugging_face_model_with_every_option (``-m slow``)."""
    from kvfast.cli import build_parser, main
    from kvfast.commands.check import EXIT_FAIL, EXIT_PASS, run_check

    (tmp_path / "hf_bugged.py").write_text(HF_BUGGED)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    bf16 = ["check", "hf_bugged:make", "--prompt", "1,2,3,4", "--mode", "control", "--continuation", "5,6,7,8"]
    assert main([*bf16, "--factory-arg", "bug=posoff", "--factory-arg", "dtype=bfloat16", "--promote"]) == 1
    assert "logic check in float64 (same tokens): BUG" in capsys.readouterr().out
    # the bfloat16 GPT-2 with a growing window of test_bfloat16_recommends_the_logic_check_when_inconclusive
    _, _, prompt, continuation = CASES[0]
    unsure = ["check", "hf_bugged:make", "--mode", "control", "--factory-arg", "bug='window'"]
    unsure += ["--factory-arg", "dtype=bfloat16", "--factory-arg", "family=gpt2"]
    unsure += ["--prompt", ",".join(map(str, prompt)), "--continuation", ",".join(map(str, continuation))]
    assert main(unsure) == 3
    assert "INCONCLUSIVE" in capsys.readouterr().out
    assert main([*bf16, "--factory-arg", "bug"]) == 2  # refused before the child starts
    assert "--factory-arg: 'bug' is not allowed; allowed: KEY=VALUE" in capsys.readouterr().err

    def in_process(*argv: str) -> dict:
        return run_check(build_parser().parse_args(list(argv)))

    base = ["check", "kvfast.testing:tiny_model", "--prompt", "1,2,3,4", "--mode", "control"]
    clean = in_process(*base, "--steps", "4", "--factory-arg", "family=gpt2", "--factory-arg", "seed=1")
    assert clean["code"] == EXIT_PASS and "ROUNDING" in clean["text"]
    split = in_process(*bf16, "--factory-arg", "bug=replay", "--split", "1", "--margin", "2", "--decisive", "8")
    assert split["code"] == EXIT_FAIL and "prompt split 1 + 3" in split["text"]
    for factory_args, line in (
        (["bug=nope"], "bug: 'nope' is not allowed"),
        (["bug=posoff", "colour=red"], "--factory-arg:"),
    ):
        refused = in_process(*bf16, *(a for arg in factory_args for a in ("--factory-arg", arg)))
        assert refused["kind"] == "bad input" and line in refused["line"], refused  # exit 2 in run()


@pytest.mark.slow
def test_cli_checks_a_hugging_face_model_with_every_option(capsys, tmp_path, monkeypatch):
    """Every flag through a real child process, one each (8 children, each importing torch); the default run
    has test_cli_checks_a_hugging_face_model (the exit codes 1 and 3 through the child, the rest of the flags
    in one process)."""
    from kvfast.cli import main

    base = ["check", "kvfast.testing:tiny_model", "--prompt", "1,2,3,4", "--mode", "control"]
    assert main([*base, "--steps", "4", "--factory-arg", "family=gpt2", "--factory-arg", "seed=1"]) == 0
    assert "ROUNDING" in capsys.readouterr().out
    (tmp_path / "hf_bugged.py").write_text(
        "from kvfast.bugs.hf import inject_hf_bug\nfrom kvfast.check.hf import HFModel\n"
        "from kvfast.testing import tiny_model\n\n"
        "def make(bug, dtype='float32', family='llama'):\n"
        "    return inject_hf_bug(HFModel(tiny_model(family, dtype)), bug)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    bf16 = ["check", "hf_bugged:make", "--prompt", "1,2,3,4", "--mode", "control", "--continuation", "5,6,7,8"]
    assert main([*bf16, "--factory-arg", "bug=posoff", "--factory-arg", "dtype=bfloat16", "--promote"]) == 1
    out = capsys.readouterr().out
    assert "logic check in float64 (same tokens): BUG" in out
    assert main([*bf16, "--factory-arg", "bug=replay", "--split", "1", "--margin", "2", "--decisive", "8"]) == 1
    assert "prompt split 1 + 3" in capsys.readouterr().out
    # the bfloat16 GPT-2 with a growing window of test_bfloat16_recommends_the_logic_check_when_inconclusive
    _, _, prompt, continuation = CASES[0]
    unsure = ["check", "hf_bugged:make", "--mode", "control", "--factory-arg", "bug='window'"]
    unsure += ["--factory-arg", "dtype=bfloat16", "--factory-arg", "family=gpt2"]
    unsure += ["--prompt", ",".join(map(str, prompt)), "--continuation", ",".join(map(str, continuation))]
    assert main(unsure) == 3
    assert "INCONCLUSIVE" in capsys.readouterr().out
    assert main([*bf16, "--factory-arg", "bug=nope"]) == 2
    assert "bug: 'nope' is not allowed" in capsys.readouterr().err
    assert main([*bf16, "--factory-arg", "bug"]) == 2
    assert "--factory-arg: 'bug' is not allowed; allowed: KEY=VALUE" in capsys.readouterr().err
    assert main([*bf16, "--factory-arg", "bug=posoff", "--factory-arg", "colour=red"]) == 2
    assert "--factory-arg:" in capsys.readouterr().err


@pytest.mark.subprocess
def test_no_deprecation_warning_from_transformers():
    """transformers 5.x warns once per process when past_key_values is passed or read; kvfast never does."""
    import subprocess
    import sys

    code = (
        "import torch; torch.set_num_threads(1)\n"
        "from kvfast.check import check_cache\n"
        "from kvfast.testing import tiny_model\n"
        "for family in ('llama', 'gpt2'):\n"
        "    check_cache(tiny_model(family), [1, 2, 3, 4], 4, mode='control', promote='float64')\n"
        "    check_cache(tiny_model(family), [1, 2, 3, 4], 4)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "deprecated" not in out.stderr + out.stdout


@pytest.mark.slow
def test_the_measured_matrix():
    """The matrix of docs/check.md (the hf_matrix study's grid: 3 seeds x 3 prompts x 24 steps, every family,
    dtype and attention): no clean run is a bug; every logic bug is "bug" natively in float32 and float64, and
    every bug in the float64 logic check, at the step where it first acts."""
    from kvfast.sweep import run_inline

    df = run_inline("hf_matrix")
    clean, bugs = df[df["bug"] == "none"], df[df["bug"] != "none"]
    assert len(clean) == 288 and (clean.verdict != "bug").all()
    assert ((bugs.logic_verdict == "bug") & bugs.logic_right_step).all()
    native = bugs[(bugs.dtype != "bfloat16") & (bugs.bug != "f16")]
    assert ((native.verdict == "bug") & native.right_step).all()


def test_the_padded_recompute_is_measured_not_kept(hf_model):
    """A left-padded recompute (the hf_matrix study with variants = "padded") is the same function on a deep copy,
    but it never lowered a clean run's largest ratio in the matrix, and in float64 eager attention its fully
    masked pad rows give NaN logits: it is not among the built-in variants."""
    from kvfast.check.hf import VARIANTS
    from kvfast.studies.hf_matrix import PaddedVariant

    assert "padded" not in VARIANTS
    model = hf_model("llama", "float32", "sdpa", 0)
    adapter = PaddedVariant(model)
    tokens = np.arange(20) % TINY_VOCAB
    reference = adapter.recompute(tokens)
    padded = adapter.recompute_variants(tokens)["padded"]
    assert (padded - reference).abs().max() < 1e-5 * reference.abs().max()
    assert adapter._copies["padded"] is not model and not any("forward" in vars(m) for m in model.modules())
    with pytest.raises(ValueError, match=r"recompute_variants \[.padded.\]: logits hold nan"):
        check_cache(PaddedVariant(hf_model("llama", "float64", "eager", 0)), [1, 2, 3, 4], 4, mode="control")
