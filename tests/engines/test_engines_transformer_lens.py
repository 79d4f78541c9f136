"""TransformerLens built in (kvfast.check.engines.transformer_lens): tiny random HookedTransformers (learned, rotary and
ALiBi positions, built from configs: no download) checked through TransformerLens's own KV cache against its uncached
forward; its catalogue bugs (kvfast.bugs.engine_bugs.TL_BUGS) found where they first act.

Marked ``transformer_lens``: TransformerLens lives in its own venv (``python3 dev.py test-tl``, which CI runs with
``KVFAST_REQUIRE_TL=1``, so these cannot skip there); elsewhere they skip.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

if os.environ.get("KVFAST_REQUIRE_TL") == "1":  # the TransformerLens CI step: run these, never skip them
    import transformer_lens  # noqa: F401
else:
    pytest.importorskip("transformer_lens")
torch = pytest.importorskip("torch")

from kvfast.bugs.engine_bugs import TL_BUGS, TL_WINDOW, inject_tl_bug  # noqa: E402
from kvfast.check import check_cache  # noqa: E402
from kvfast.check.engines.transformer_lens import NO_PADS, TLBridgeModel, TLModel, cache_class, engine_model  # noqa: E402
from kvfast.testing import POSITIONALS, tiny_llama, tiny_tl_config, tiny_tl_model  # noqa: E402

pytestmark = pytest.mark.transformer_lens
PROMPT = [3, 4, 5, 6, 7, 8, 9, 10, 11]
SHORT = [3, 4, 5]  # the evict bug then first acts at step 6
CONTINUATION = list(range(20, 44))  # a random model's greedy tokens repeat one token: these exercise more positions
PASSING = ("exact", "rounding")


@functools.cache
def model(positional: str, dtype: str = "float32"):
    return tiny_tl_model(positional, dtype, seed=1)


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("positional", POSITIONALS)
def test_a_clean_hooked_transformer_passes_as_the_user_has_it(positional, dtype):
    tl = model(positional, dtype)
    report = check_cache(tl, PROMPT, 24, continuation=CONTINUATION, promote="float64")  # the model itself: wrapped
    assert report.verdict in PASSING and report.promoted.verdict in PASSING, report.format()
    assert report.promoted.logits_format == "float64" and report.logits_format == dtype
    assert tl.cfg.dtype == getattr(torch, dtype) and tl.W_E.dtype == getattr(torch, dtype)  # promoted on a copy


def _assert_found_where_it_first_acts(report, bug: str) -> None:
    """``bug`` is the check's verdict, in each scenario at the step where it first acts; a scenario it never reaches
    passes (the control)."""
    assert report.verdict == "bug", report.format()
    for name, scenario in report.scenarios.items():
        acts = TL_BUGS[bug].first_acting_step(name, len(SHORT))
        if acts is None:  # the control: a scenario the bug never reaches stays clean
            assert scenario.verdict in PASSING, report.format()
        else:
            assert scenario.verdict == "bug" and scenario.first_bug_step == acts, report.format()


@pytest.mark.parametrize("bug", sorted(TL_BUGS))
@pytest.mark.parametrize("positional", POSITIONALS)
def test_each_bug_is_a_bug_at_the_step_where_it_first_acts(positional, bug):
    report = check_cache(inject_tl_bug(TLModel(model(positional)), bug), SHORT, 16, continuation=CONTINUATION[:16])
    _assert_found_where_it_first_acts(report, bug)


@pytest.mark.parametrize("bug", sorted(TL_BUGS))
def test_in_bfloat16_the_float64_logic_check_finds_each_bug_where_it_first_acts(bug):
    adapter = inject_tl_bug(TLModel(model("alibi", "bfloat16")), bug)
    report = check_cache(adapter, SHORT, 16, continuation=CONTINUATION[:16], promote="float64")
    assert report.promoted.verdict == "bug", report.format()
    for name, scenario in report.promoted.scenarios.items():
        acts = TL_BUGS[bug].first_acting_step(name, len(SHORT))
        assert scenario.first_bug_step == acts, report.format()


def test_the_evict_window_is_where_the_catalogue_says():
    adapter = inject_tl_bug(TLModel(model("rotary")), "evict")
    adapter.prefill(np.arange(3, 3 + TL_WINDOW - 1))
    adapter.decode(20)
    assert adapter.length == TL_WINDOW  # not yet full before this decode: nothing evicted
    adapter.decode(21)
    assert adapter.length == TL_WINDOW  # full before it: the oldest position dropped, the new one appended


# --- what the adapter sets right for TransformerLens ---------------------------------------------------------------


class _KeepsAlibi(TLModel):
    """The control: the adapter without its reset of the ALiBi buffers."""

    def _reset_alibi(self) -> None:
        pass


@pytest.mark.parametrize(("adapter_class", "same"), [(TLModel, True), (_KeepsAlibi, False)])
def test_a_longer_recompute_does_not_change_a_later_cached_call_under_alibi(adapter_class, same):
    adapter = adapter_class(tiny_tl_model("alibi", seed=2))
    before = adapter.prefill(np.array(PROMPT)).clone()
    adapter.recompute(np.arange(64) % 50)  # grows TransformerLens's bias matrix to 64 positions
    after = adapter.prefill(np.array(PROMPT))
    assert torch.equal(before, after) is same, float((before - after).abs().max())
    assert torch.allclose(before, after, rtol=0, atol=1e-5)  # a shift of the scores: rounding, not another function


def test_the_cached_forward_needs_no_tokenizer_and_the_models_own_is_put_back():
    tl = tiny_tl_model("standard", seed=3)
    ids = torch.tensor([PROMPT])
    # the control: TransformerLens alone (3.x, 2.16: "Cannot compute attention mask without a tokenizer"; 2.7:
    # "'NoneType' object has no attribute 'pad_token_id'")
    with pytest.raises((ValueError, AttributeError), match="without a tokenizer|pad_token_id"):
        tl(ids, past_kv_cache=cache_class().init_cache(tl.cfg, tl.cfg.device, 1))
    own = object()  # no tokenizer attribute at all: any read of it by a forward would fail
    tl.tokenizer = own
    assert check_cache(tl, PROMPT, 8).verdict in PASSING
    assert tl.tokenizer is own
    adapter = TLModel(tl)
    with pytest.raises(IndexError):  # a token past the vocabulary fails inside the forward
        adapter.prefill(np.array([10**6]))
    assert tl.tokenizer is own and NO_PADS.pad_token_id < 0


def test_the_rows_variant_measures_the_order_of_one_row_products():
    tl = model("standard", "float64")
    assert not [m for m in tl.modules() if isinstance(m, torch.nn.Linear)]  # why a per-layer row variant does nothing
    adapter = TLModel(tl)
    tokens = np.arange(3, 3 + 33)
    reference = adapter.recompute(tokens)
    rows = adapter.recompute_variants(tokens)["rows"]
    scale = float(reference.abs().max())
    assert not torch.equal(rows, reference)  # another order of additions: some bits move
    assert float((rows - reference).abs().max()) <= 64 * np.finfo(np.float64).eps * scale  # by rounding only
    assert TLModel(tl, variants=()).recompute_variants(tokens) == {}


def test_promote_is_the_same_adapter_over_a_float64_copy():
    tl = model("rotary", "bfloat16")
    adapter = inject_tl_bug(TLModel(tl), "freeze")
    promoted = adapter.promote("float64")
    assert type(promoted) is type(adapter) and promoted.model is not tl
    assert promoted.model.cfg.dtype == torch.float64 and set(promoted.internal_formats.values()) == {"float64"}
    assert tl.cfg.dtype == torch.bfloat16 and "bfloat16" in adapter.internal_formats.values()


def test_bad_input_is_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"^path: .*missing\.json.* is not allowed; allowed: a transformer_lens"):
        TLModel(tmp_path / "missing.json")
    with pytest.raises(ValueError, match=r"^path: 'Module' is not allowed; allowed: a transformer_lens"):
        TLModel(torch.nn.Module())
    with pytest.raises(ValueError, match=r"^variants: 'batch' is not allowed; allowed: rows"):
        TLModel(model("standard"), variants=("batch",))
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({**tiny_tl_config(), "dtype": "float8"}))
    with pytest.raises(ValueError, match=r"tiny\.json: dtype: 'float8' is not allowed; allowed: bfloat16, float16"):
        TLModel(config)
    config.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"^path: .* \(a JSON object\)"):
        TLModel(config)
    adapter = TLModel(model("standard"))
    with pytest.raises(ValueError, match=r"^cache: empty; allowed: call prefill"):
        adapter.decode(3)
    with pytest.raises(ValueError, match=r"^dtype: 'float32' is not allowed; allowed: float64"):
        adapter.promote("float32")


def test_a_config_file_with_saved_weights_is_the_saved_model(tmp_path):
    tl = tiny_tl_model("alibi", seed=4)
    config, weights = tmp_path / "tiny.json", tmp_path / "tiny.pt"
    config.write_text(json.dumps(tiny_tl_config("alibi")))
    torch.save(tl.state_dict(), weights)
    tokens = np.array(PROMPT)
    loaded = TLModel(config, weights=str(weights))
    assert torch.equal(loaded.recompute(tokens), TLModel(tl).recompute(tokens))
    assert not torch.equal(TLModel(config, seed=5).recompute(tokens), TLModel(tl).recompute(tokens))  # the control


@pytest.mark.subprocess
def test_kvfast_check_engine_transformer_lens_and_a_factory_that_returns_a_hooked_transformer(tmp_path):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(tiny_tl_config("rotary", "float64")))
    cli = [sys.executable, "-c", "import sys; from kvfast.cli import main; sys.exit(main())", "check"]
    args = ["--prompt", "3,4,5,6,7", "--steps", "12", "--factory-arg", "seed=1"]
    done = subprocess.run([*cli, "--engine", "transformer_lens", str(config), *args], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0 and "PASS" in done.stdout, done.stdout + done.stderr
    from kvfast.commands.check import build_model

    built = build_model("kvfast.testing:tiny_tl_model", {"positional": "alibi"})
    assert type(built).__name__ == "HookedTransformer"  # as a factory returns it: check_cache wraps it
    with pytest.raises(ValueError, match="returns no model under test"):  # the control: another torch module
        build_model("torch.nn:Identity", {})


# --- the TransformerBridge (3.x, 4.x) over a transformers model ------------------------------------------------------


def bridge_class():
    """TransformerLens's ``TransformerBridge`` (3.x, 4.x); 2.x has none: its tests skip there, except in CI."""
    if os.environ.get("KVFAST_REQUIRE_TL") == "1":
        from transformer_lens.model_bridge import TransformerBridge

        return TransformerBridge
    found = pytest.importorskip("transformer_lens.model_bridge", reason="this TransformerLens has no bridge (2.x)")
    return found.TransformerBridge


@pytest.fixture(scope="module")
def bridge(tmp_path_factory):
    TransformerBridge = bridge_class()  # noqa: N806 - TransformerLens's class
    directory = tmp_path_factory.mktemp("bridge")
    tiny_llama(directory, seed=1)  # the tiny Llama and a word-level tokenizer (no download)
    return TransformerBridge.boot_transformers(str(directory))


def test_a_clean_transformer_bridge_passes_as_the_user_has_it(bridge):
    report = check_cache(bridge, PROMPT, 16, continuation=CONTINUATION[:16], promote="float64")
    assert report.verdict in PASSING and report.promoted.verdict in PASSING, report.format()


@pytest.mark.parametrize("bug", sorted(TL_BUGS))
def test_each_bug_in_the_bridges_cache_is_a_bug_at_the_step_where_it_first_acts(bridge, bug):
    report = check_cache(inject_tl_bug(TLBridgeModel(bridge), bug), SHORT, 16, continuation=CONTINUATION[:16])
    _assert_found_where_it_first_acts(report, bug)


class _DeclaresFloat64(TLBridgeModel):
    """The control: the bridge adapter declaring its promoted model float64 throughout."""

    internal_formats = {"softmax": "float64"}


@pytest.mark.parametrize(
    ("adapter_class", "verdict"), [(TLBridgeModel, "rounding"), (_DeclaresFloat64, "length-dependent")]
)
def test_the_bridges_float32_softmax_is_measured_so_its_float64_logic_check_passes(bridge, adapter_class, verdict):
    adapter = adapter_class(bridge)
    report = check_cache(adapter, PROMPT, 16, continuation=CONTINUATION[:16], promote="float64")
    assert report.promoted.verdict == verdict, report.format()
    if adapter_class is TLBridgeModel:  # eager attention: transformers' softmax in float32 even in a float64 model
        assert adapter.promote("float64").internal_formats["softmax"] == "float32"


def test_the_engine_opens_a_model_directory_as_a_bridge_and_a_file_as_a_config(tmp_path):
    bridge_class()
    directory = tmp_path / "llama"
    tiny_llama(directory, seed=2)
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(tiny_tl_config()))
    assert type(engine_model(str(directory))) is TLBridgeModel and type(engine_model(config, seed=1)) is TLModel
    with pytest.raises(ValueError, match=r"^path: 'HookedTransformer' is not allowed; allowed: a transformer_lens Tr"):
        TLBridgeModel(model("standard"))
