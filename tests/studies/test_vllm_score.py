"""The vLLM bug scoring table (kvfast.studies.vllm_score): vLLM's test criterion as a step, the preemption
scenario's sizing, the measured first acting step against the catalogue's, and data that makes each detector
miss (the three-token check a bug acting at step 25, vLLM's criterion a bug that changes no token for 8 steps,
kvfast's checks a bug that does not act within the steps).

The criterion tests need no vLLM; the engine tests are marked ``vllm`` (vLLM's own venv: ``python3 dev.py
test-vllm``) and skip where vllm is not installed. One float32 engine for the file.
"""

from __future__ import annotations

import os

import pytest

from kvfast.studies import vllm_score as vs

# --- vLLM's criterion and the scenario's sizing (no engine) ---------------------------------------------------


def test_vllm_criterion_passes_equal_tokens_and_fails_at_the_first_token_outside_the_other_top():
    tokens = [5, 6, 7, 8]
    top = [{t} for t in tokens]
    assert vs.logprobs_close(tokens, top, list(tokens), top) is None
    other = [5, 6, 9, 3]
    assert vs.logprobs_close(tokens, top, other, [{t} for t in other]) == 2
    # each token among the other's top logprobs (more than one asked for): vLLM's criterion passes, and stops there
    assert vs.logprobs_close(tokens, [{5}, {6}, {7, 9}, {8}], other, [{5}, {6}, {9, 7}, {3}]) is None


def test_vllm_criterion_misses_whatever_leaves_the_tokens_alone():
    # the logits may differ at every step: only token ids are compared
    tokens = [5, 6, 7]
    assert vs.logprobs_close(tokens, [{t} for t in tokens], tokens, [{t} for t in tokens]) is None


def test_the_preemption_scenario_outgrows_its_blocks_only_after_the_prefill():
    for length in vs.PROMPT_LENGTHS:
        others = vs.companions_for(length, vs.STEPS)
        start, end = -(-length // vs.BLOCK), -(-(length + vs.STEPS + 1) // vs.BLOCK)
        assert (others + 1) * start <= vs.KV_BLOCKS < (others + 1) * end
        assert others == 1 or others * end <= vs.KV_BLOCKS  # the fewest
    with pytest.raises(ValueError, match="^steps: "):
        vs.companions_for(200, 8)  # two requests of 7 blocks do not fit at their prefill


# --- on vLLM ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    if os.environ.get("KVFAST_REQUIRE_VLLM") == "1":  # the vLLM CI job: run these, never skip them
        import vllm  # noqa: F401
    else:
        pytest.importorskip("vllm")
    from kvfast.testing import tiny_vllm_model

    return vs.Engines(tiny_vllm_model(tmp_path_factory.mktemp("vllm-score"), seed=1))


def case(engines, bug, scenario="decode", prompt_len=40, steps=vs.STEPS):
    config = {"dtype": "float32", "scenario": scenario, "prompt_len": prompt_len, "steps": steps}
    return vs.VLLMCase(config, bug, engines)


@pytest.mark.vllm
@pytest.mark.parametrize(
    "bug, scenario, prompt_len", [("evict", "decode", 40), ("short", "resume", 70), ("hitpos", "resume", 70)]
)
def test_the_measured_first_acting_step_is_the_catalogues(engines, bug, scenario, prompt_len):
    from kvfast.bugs.engine_bugs import first_acting_step

    acts, _ = vs.acting_step(case(engines, bug, scenario, prompt_len))
    assert acts == first_acting_step(bug, scenario, prompt_len) is not None


@pytest.mark.vllm
def test_a_bug_acting_at_step_25_is_missed_by_the_three_token_check_only(engines):
    c = case(engines, "evict")  # prompt 40: decode drops the first block from step 25 on
    assert vs.acting_step(c)[0] == 25
    found = {name: fn(c.model(), c) for name, fn in vs.DETECTORS.items()}
    assert not found["three_token_allclose"].flag
    assert {name: d.step for name, d in found.items() if d.flag} == {
        "vllm_logprobs": 25, "kvfast_exact": 25, "kvfast_control": 25
    }  # fmt: skip


@pytest.mark.vllm
def test_a_bug_that_changes_no_token_for_8_steps_is_missed_by_vllms_criterion_only(engines):
    c = case(engines, "short", steps=8)  # prompt 40: decode attends only the first block from step 1 on
    assert vs.acting_step(c)[0] == 1
    found = {name: fn(c.model(), c) for name, fn in vs.DETECTORS.items()}
    assert not found["vllm_logprobs"].flag
    assert {name: d.step for name, d in found.items() if d.flag} == {
        "three_token_allclose": 1, "kvfast_exact": 1, "kvfast_control": 1
    }  # fmt: skip


@pytest.mark.vllm
def test_a_bug_that_does_not_act_within_the_steps_is_missed_by_every_detector_and_left_out_of_the_scores(engines):
    quiet = case(engines, "evict", steps=8)  # acts at step 25
    clean = case(engines, None, steps=8)
    loud = case(engines, "short", steps=8)
    table = vs.detections([clean, quiet, loud])
    assert table["acts"].isna().tolist() == [True, True, False]
    for name in vs.DETECTORS:
        assert table[f"{name}.flag"].tolist()[:2] == [False, False], name
    scores = vs.scores(table).set_index("bug")
    assert list(scores.index) == ["short", "all"] and scores.loc["all", "cases"] == 1  # the quiet case left out
    assert scores.loc["short", "kvfast_exact.recall"] == 1.0 and scores.loc["short", "vllm_logprobs.recall"] == 0.0
    lines = vs.case_markdown(table).splitlines()  # the clean control left out
    assert [line.split(" | ")[2:] for line in lines[2:]] == [
        ["evict", "-", "-", "-", "-", "- |"], ["short", "1", "1", "-", "1", "1 |"]
    ]  # fmt: skip


@pytest.mark.vllm
def test_the_command_prints_the_tables_of_docs_engines_md(engines, monkeypatch, capsys):
    monkeypatch.setattr(vs, "SCENARIOS", ("decode",))
    monkeypatch.setattr(vs, "PROMPT_LENGTHS", (70,))
    monkeypatch.setattr(vs, "Engines", lambda model_dir: engines)  # the file's engine, not a second one
    assert vs.main(["--steps", "4", "--dtypes", "float32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "vLLM bugs, tiny Llama (seed 1), prompts 70, 4 steps"
    rows = [line for line in lines if line.startswith("| decode | 70 |")]
    assert [r.split(" | ")[2:] for r in rows] == [
        ["evict", "1", "1", "1", "1", "1 |"],
        ["short", "1", "1", "1", "1", "1 |"],
        ["hitpos", "-", "-", "-", "-", "- |"],
    ]
    assert "| all | float32 | 2 | 1.000, 1, 1.000 (FPR 0.000) |" in "\n".join(lines)
