"""``kvfast scan`` and the ``hf_scan`` study: tiny configs of every architecture (shrunk, with what matters to the
cache kept), the scoreboard's counts, bad input in one line, and a small scan end to end (two architectures and
one transformers cannot run as a KV-cache model), resumed and drawn by the report."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from shared import HF, environment
from shared import kvfast as run_kvfast

from kvfast.commands import scan as scan_command
from kvfast.studies import STUDIES, hf_common, hf_scan
from kvfast.studies import architectures as A

ENV = environment(OMP_NUM_THREADS="1")


def kvfast(*args: str) -> subprocess.CompletedProcess:
    return run_kvfast(*args, script=True, env=ENV, timeout=600)


# --- shrinking a config -------------------------------------------------------------------------------------

GEMMA2_LIKE = {
    "vocab_size": 256000,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "pad_token_id": 0,
    "eos_token_id": 255999,
    "sliding_window": 4096,
    "layer_types": ["sliding_attention", "full_attention"] * 13,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "use_cache": True,
}


def test_shrink_makes_sizes_tiny_and_keeps_what_matters_to_the_cache():
    out = A.shrink(GEMMA2_LIKE)
    assert out == {
        "vocab_size": A.VOCAB,
        "hidden_size": A.HIDDEN,
        "intermediate_size": A.FFN,
        "num_hidden_layers": 2,
        "num_attention_heads": A.HEADS,
        "num_key_value_heads": A.KV_HEADS,
        "head_dim": A.HEAD_DIM,
        "sliding_window": A.WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
    }  # soft-capping, rope parameters and token ids outside the vocabulary are not touched


def test_prompts_never_hold_the_padding_token():
    config = {"seed": 0, "prompt": 0, "steps": 200}
    prompt, continuation = hf_scan.tokens(config, None)
    assert 1 in continuation  # the stream draws it ...
    prompt, continuation = hf_scan.tokens(config, 1)
    assert 1 not in prompt and 1 not in continuation  # ... and a model whose padding token it is never sees it
    assert A.VOCAB == hf_common.TINY_VOCAB


def test_shrink_keeps_one_layer_of_each_type_and_renumbers_per_layer_tables():
    types = ["sliding"] * 5 + ["full"] + ["sliding"] * 5 + ["full"]
    d = {"num_hidden_layers": 12, "layer_types": types, "per_layer_config": {"05": {"head_dim": 512}}}
    out = A.shrink(d)
    assert out["num_hidden_layers"] == 2 and out["layer_types"] == ["sliding", "full"]
    assert out["per_layer_config"] == {"01": {"head_dim": 512}}  # layer 5 is the tiny model's layer 1


def test_shrink_gives_a_hybrid_model_an_attention_layer_and_a_pattern_one_period():
    jamba = A.shrink({"num_hidden_layers": 32, "attn_layer_period": 8, "attn_layer_offset": 4})
    assert (jamba["num_hidden_layers"], jamba["attn_layer_period"], jamba["attn_layer_offset"]) == (2, 2, 1)
    recurrent = A.shrink({"num_hidden_layers": 26, "block_types": ["recurrent", "recurrent", "attention"]})
    assert recurrent["num_hidden_layers"] == 3
    mla = A.shrink({"num_attention_heads": 128, "num_key_value_heads": 128, "qk_rope_head_dim": 64})
    assert mla == {"num_attention_heads": A.HEADS, "num_key_value_heads": A.HEADS, "qk_rope_head_dim": A.HEAD_DIM}


def test_shrink_makes_encoders_decoders_and_shrinks_sub_configs():
    out = A.shrink({"is_decoder": False, "text_config": {"model_type": "x", "hidden_size": 4096}})
    assert out["is_decoder"] is True
    assert out["text_config"] == {"model_type": "x", "hidden_size": A.HIDDEN}


# --- the scoreboard ---------------------------------------------------------------------------------------------


def _row(arch, dtype="float32", scenario="decode", bug="none", verdict="rounding", **kw) -> dict:
    base = {
        "architecture": arch, "dtype": dtype, "attention": "auto", "scenario": scenario, "seed": 0, "prompt": 0,
        "steps": 8, "bug": bug, "promote": "none", "status": "ok", **dict.fromkeys(hf_scan.RESULT_FIELDS),
        "verdict": verdict, "acting_step": -1, "attention_used": "sdpa", "check_s": 0.1,
    }  # fmt: skip
    return {**base, **kw}


RUNS = pd.DataFrame(
    [
        _row("a"),
        _row("a", verdict="bug"),  # a clean run called bug: a false positive
        _row("a", bug="posoff", verdict="bug", first_bug_step=1, acting_step=1, right_step=True),
        _row("a", bug="freeze", verdict="rounding", first_bug_step=-1, acting_step=2, right_step=False),
        _row("a", bug="replay", verdict="rounding", acting_step=-1),  # never acts in decode: not scored
        _row(
            "b",
            scenario="resume",
            bug="posoff",
            verdict="rounding",
            logic_verdict="bug",
            first_bug_step=-1,
            logic_step=1,
            acting_step=1,
            right_step=False,
        ),  # fmt: skip
        _row("b", scenario="resume"),
        _row("c", verdict="skipped", skip_kind="adapter", reason="no KV cache"),
        _row("c", bug="posoff", verdict="skipped", skip_kind="adapter", reason="no KV cache", acting_step=None),
        _row(
            "b",
            bug="freeze",
            verdict="skipped",
            skip_kind="run",
            acting_step=None,
            reason="model.decode(1) raised ValueError: bug: 'freeze' is not allowed; allowed: a bug ...",
        ),  # fmt: skip
    ]
)


def test_scoreboard_counts_clean_verdicts_bugs_found_and_false_positives():
    board = hf_scan.scoreboard(RUNS).set_index("architecture")
    assert list(board.index) == ["a", "b"]  # c: every run skipped, listed apart
    assert board.loc["a", "float32/decode"] == "bug 1, rounding 1"
    assert (board.loc["a", "bugs_found"], board.loc["a", "at_right_step"], board.loc["a", "fpr"]) == ("1/2", 1, 0.5)
    assert board.loc["b", "bugs_found"] == "1/1" and board.loc["b", "fpr"] == 0.0  # found by the logic check
    assert board.loc["b", "steps_to_detect"] == 0.0
    skipped = hf_scan.skipped_table(RUNS)
    assert skipped.to_dict("records") == [
        {"architecture": "c", "skipped": "1/1", "kind": "adapter", "reason": "no KV cache"}
    ]
    assert hf_scan.coverage(RUNS) == (2, 3)
    bugs = hf_scan.bug_table(RUNS).set_index("bug")
    assert bugs.loc["freeze", "missed_on"] == "a" and bugs.loc["posoff", "found"] == 2
    assert bugs.loc["freeze", "not_injectable_on"] == "b"  # b runs clean; c, skipped altogether, is not listed
    assert bugs.loc["posoff", "not_injectable_on"] == ""


def test_a_refusal_of_kvfast_inside_a_model_call_is_the_adapters():
    refusal = "model.decode(1) raised ValueError: bug: 'posoff' is not allowed; allowed: x"
    assert hf_scan.kind_of("run", refusal) == "adapter"
    assert hf_scan.kind_of("run", "model.recompute(<4 tokens>) raised RuntimeError: shape mismatch") == "run"
    assert hf_scan.kind_of("config", "config: ValueError: x is not allowed; allowed: y") == "config"


def test_heatmap_cells_are_the_worst_clean_verdict():
    table = hf_scan.heatmap_table(RUNS).set_index("architecture")
    assert table.loc["a", "float32/decode"] == "bug"
    assert table.loc["b", "float32/resume"] == "rounding"
    assert table.loc["c", "float32/decode"] == "skipped"


def test_the_scan_spec_runs_each_bug_where_it_acts():
    spec = hf_scan.scan_spec(["llama"], ["float32", "bfloat16"], ["decode", "resume"], bugs=["posoff", "replay"])
    clean, *bugs = spec["union"]
    assert clean["tied"] == [{"dtype": ["float32", "bfloat16"], "promote": ["none", "float64"]}]
    assert [(b["fixed"]["scenario"], b["axes"]["bug"]) for b in bugs] == [
        ("decode", ["posoff"]),
        ("resume", ["posoff", "replay"]),
    ]
    assert hf_scan.scan_spec(["llama"], bugs=[])["union"][1:] == []


@pytest.mark.subprocess
def test_the_study_is_registered_and_imports_no_torch():
    assert "hf_scan" in STUDIES and not STUDIES["hf_scan"].reproduce
    code = "import sys, kvfast.studies.hf_scan, kvfast.commands.scan; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, check=True)
    assert out.stdout.strip() == "False"


# --- the command ------------------------------------------------------------------------------------------------


def _args(**kw) -> argparse.Namespace:
    base = {"families": None, "dtypes": None, "scenarios": None, "seeds": 2, "prompts": 2, "steps": 16}
    return argparse.Namespace(**{**base, "attention": "auto", "bugs": None, "jobs": None, **kw})


@pytest.mark.skipif(not HF, reason="needs kvfast[hf] (torch and transformers)")
@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"families": ["llama", "nope"]}, "--families: 'nope' is not allowed; allowed: afmoe, "),
        ({"dtypes": ["float16"]}, "--dtypes: 'float16' is not allowed; allowed: float32, float64, bfloat16"),
        ({"scenarios": ["decode,rewind"]}, "--scenarios: 'rewind' is not allowed; allowed: decode, resume"),
        ({"bugs": ["typo"]}, "--bugs: 'typo' is not allowed; allowed: window, posoff, freeze, f16, restart, replay"),
        ({"attention": "flash"}, "--attention: 'flash' is not allowed; allowed: auto, sdpa, eager"),
        ({"mode": "strict"}, "--mode: 'strict' is not allowed; allowed: auto, exact, control"),
        ({"steps": 0}, "--steps: 0 is not allowed; allowed: "),
        ({"jobs": 0}, "--jobs: 0 is not allowed; allowed: "),
    ],
)
def test_bad_input_names_the_option_and_the_allowed_values(kw, message):
    with pytest.raises(ValueError) as info:
        scan_command.build_grid(_args(**kw))
    assert str(info.value).startswith(message)


def test_the_default_scan_covers_every_architecture_of_the_installed_transformers():
    if not HF:
        pytest.skip("needs kvfast[hf] (torch and transformers)")
    grid = scan_command.build_grid(_args())
    per_arch = 2 * 2 * 2 * 2 + 4 + 6  # scenarios x dtypes x seeds x prompts clean; bugs where they act
    assert len(grid) == per_arch * len(A.causal_lm_types())


@pytest.mark.subprocess
@pytest.mark.skipif(not HF, reason="needs kvfast[hf] (torch and transformers)")
def test_bad_input_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    out = kvfast("scan", "--families", "llama", "nope", "--out", str(tmp_path / "x"))
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("kvfast: error: --families: 'nope' is not allowed; allowed: afmoe, ")
    assert not (tmp_path / "x").exists()


SMALL_SCAN = ["scan", "--families", "llama,gpt2", "rwkv", "--dtypes", "float32", "--seeds", "1", "--prompts", "1"]
SMALL_SCAN += ["--steps", "6", "--bugs", "posoff", "replay", "--jobs", "2", "--quiet", "--markdown"]


def small_scan(out: Path) -> list[str]:
    """Run the small scan (two architectures and rwkv, which transformers cannot run as a KV-cache model) into
    ``out``, check its rows, its printed scoreboard and the scoreboard file; return its command line."""
    cmd = [*SMALL_SCAN, "--out", str(out)]
    first = kvfast(*cmd)
    assert first.returncode == 0, first.stderr
    assert "2 of 3 architectures checked" in first.stdout
    df = pd.read_parquet(out)
    assert len(df) == 15 and (df["status"] == "ok").all()  # 3 x (2 clean + posoff in decode, posoff and replay)
    rwkv = df[df["architecture"] == "rwkv"]
    assert (rwkv["verdict"] == "skipped").all() and (rwkv["skip_kind"] == "adapter").all()
    ran = df[df["architecture"] != "rwkv"]
    assert (ran.loc[ran["bug"] == "none", "verdict"] == "rounding").all()
    assert (ran.loc[ran["bug"] != "none", "verdict"] == "bug").all() and ran.loc[
        ran["bug"] != "none", "right_step"
    ].all()
    assert "| llama | sdpa | rounding 1 | rounding 1 | 3/3 | 3 | 0 | 0 |" in first.stdout
    assert "| rwkv | 2/2 | adapter |" in first.stdout  # its clean runs
    board = (out.parent / f"{out.name}.report" / "scoreboard.md").read_text()
    assert "| gpt2 |" in board and "| rwkv |" in board
    return cmd


@pytest.mark.subprocess
@pytest.mark.skipif(not HF, reason="needs kvfast[hf] (torch and transformers)")
def test_a_small_scan_end_to_end(tmp_path):
    """The scan itself; resumed and drawn by `kvfast report` (two more processes): the ``-m slow`` twin below
    (the resume of any sweep: tests/sweep/test_sweep_cli.py; hf_scan's figure and skipped table in the report:
    tests/report/test_report.py)."""
    small_scan(tmp_path / "hf_scan")


@pytest.mark.slow
@pytest.mark.skipif(not HF, reason="needs kvfast[hf] (torch and transformers)")
def test_a_small_scan_end_to_end_resumed_and_reported(tmp_path):
    out = tmp_path / "hf_scan"
    cmd = small_scan(out)
    again = kvfast(*cmd)
    assert again.returncode == 0 and "15 already stored, 0 run now" in again.stdout, again.stdout
    report = kvfast("report", str(out), "--out", str(tmp_path / "rep"))
    assert report.returncode == 0, report.stderr
    page = (tmp_path / "rep" / "report.html").read_text()
    assert STUDIES["hf_scan"].figures[0].title in page and "hf_scan_skipped" in page


@pytest.mark.skipif(not HF, reason="needs torch and transformers (kvfast[hf])")
def test_rotary_scalings_are_scanned_and_only_the_length_dependent_ones_are_named():
    import torch

    from kvfast.check import check_cache

    torch.set_num_threads(1)
    assert {"llama+dynamic", "llama+yarn", "phi3+longrope"} <= set(A.causal_lm_types())
    prompt = list(range(3, 10))  # 7 tokens + 12 steps: past ROPE_LIMIT = 16 positions
    for arch, verdict in (("llama+dynamic", "length-dependent"), ("phi3+longrope", "length-dependent"),
                          ("llama+yarn", "rounding")):  # fmt: skip
        report = check_cache(A.tiny_architecture(arch, "float32", "auto", 0), prompt, 12, mode="control")
        assert report.verdict == verdict, (arch, report.format())


# --- builds that the shrinking used to break; state-space models driven as generate drives them ----------------

#: Types skipped before only because of kvfast's shrinking (fields the default config leaves to the checkpoint,
#: constraints between fields): each now builds and runs one forward.
FIXED_TYPES = (
    "hunyuan_v1_dense", "ministral", "nemotron", "dots1", "deepseek_v2", "dbrx", "cohere_compass_text",
    "lfm2_moe", "granitemoehybrid", "zamba", "qwen4_exp_text", "dory", "kimi_linear", "bailing_hybrid",
)  # fmt: skip


@pytest.mark.skipif(not HF, reason="needs torch and transformers (kvfast[hf])")
@pytest.mark.parametrize("model_type", FIXED_TYPES)
def test_types_the_shrinking_used_to_break_build_and_run(model_type):
    import torch

    if model_type not in A.causal_lm_types():
        pytest.skip(f"{model_type} is not in this transformers release")
    model = A.tiny_architecture(model_type)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]]), use_cache=True).logits
    assert logits.shape[-1] == model.config.vocab_size


def test_derived_fields_get_the_value_their_none_stands_for():
    d = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None}
    out = A.shrink(d)
    assert out["head_dim"] == A.HIDDEN // A.HEADS
    assert out["num_key_value_heads"] == A.HEADS
    assert "head_dim" not in A.shrink({"hidden_size": 4096, "num_attention_heads": 32})  # absent stays absent


def _scan_run(arch: str, scenario: str = "decode", bug: str = "none") -> dict:
    c = {"architecture": arch, "dtype": "float32", "attention": "auto", "scenario": scenario, "seed": 0,
         "prompt": 0, "steps": 8, "bug": bug, "promote": "none", "mode": "auto"}  # fmt: skip
    return hf_scan.run(c)


@pytest.mark.skipif(not HF, reason="needs torch and transformers (kvfast[hf])")
def test_a_state_space_model_gets_no_attention_mask_after_its_prefill_as_generate_gives_it():
    """Mamba's ``generate`` drops the mask after the first call; the adapter used to pass one over every position,
    which its mixer broadcast into one row per position: clean Mamba was called ``bug`` at decode step 2."""
    import torch

    from kvfast.check.hf import HFModel

    mamba = HFModel(A.tiny_architecture("mamba"))
    mamba.prefill([1, 2, 3, 4])
    mask = torch.ones(1, 5, dtype=torch.long)
    assert mamba._generate_passes_mask(mamba._ids([5], mamba.length), mask) is False
    llama = HFModel(A.tiny_architecture("llama"))
    llama.prefill([1, 2, 3, 4])
    assert llama._generate_passes_mask(llama._ids([5], llama.length), mask) is True  # attention models keep it
    assert _scan_run("mamba")["verdict"] == "rounding"  # old behaviour: "bug"


@pytest.mark.skipif(not HF, reason="needs torch and transformers (kvfast[hf])")
def test_a_state_space_model_equals_its_own_generate_bit_for_bit():
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from kvfast.check.hf import HFModel

    model = A.tiny_architecture("mamba")
    prompt, continuation = [5, 9, 13, 22], [31, 40, 7, 18, 2]

    class Force(LogitsProcessor):  # generate's greedy choice forced to the continuation
        def __call__(self, input_ids, scores):
            forced = torch.full_like(scores, float("-inf"))
            forced[:, continuation[input_ids.shape[1] - len(prompt)]] = 0
            return scores + forced

    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(continuation),
                         min_new_tokens=len(continuation), do_sample=False, output_logits=True,
                         return_dict_in_generate=True, logits_processor=LogitsProcessorList([Force()]),
                         pad_token_id=0)  # fmt: skip
    adapter = HFModel(model)
    adapter.prefill(prompt)
    decoded = torch.stack([adapter.decode(t) for t in continuation[:-1]])
    assert torch.equal(decoded, torch.stack([g[0] for g in out.logits[1:]]))


@pytest.mark.skipif(not HF, reason="needs torch and transformers (kvfast[hf])")
def test_injected_bugs_are_still_found_on_a_state_space_model_or_refused():
    assert _scan_run("mamba2", "resume", "replay")["verdict"] == "bug"
    refused = _scan_run("mamba", "decode", "window")  # the bug lives in a mask Mamba's generate never passes
    assert refused["verdict"] == "skipped" and refused["skip_kind"] == "adapter"


@pytest.mark.skipif(not HF, reason="needs torch and transformers (kvfast[hf])")
def test_cached_calls_get_generates_positions_where_they_are_the_models_own():
    """Bamba's forward without ``position_ids`` numbers a decoded token from 0 (``generate`` always passes them):
    clean Bamba was called ``bug`` in float32. RoBERTa numbers positions from its padding id: it keeps its own."""
    from kvfast.check.hf import HFModel

    assert HFModel(A.tiny_architecture("bamba"))._generate_positions() is True
    assert HFModel(A.tiny_architecture("roberta"))._generate_positions() is False
    assert _scan_run("bamba")["verdict"] == "rounding"  # old behaviour: "bug"
