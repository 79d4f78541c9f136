"""vLLM built in (kvfast.check.engines.vllm): a tiny random Llama (hidden 128, 4 heads of 32: vLLM's CPU attention
takes no smaller head) checked through vLLM's own cached path against vLLM's own prefill; its catalogue bugs
(kvfast.bugs.engines), injected through the CPU attention metadata, found where they first act.

Marked ``vllm``: vLLM's CPU build needs its own venv (``python3 dev.py test-vllm``); elsewhere these skip. One
engine per dtype for the whole file (building one costs seconds); the bugs reuse the engines' ``LLM``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

if os.environ.get("KVFAST_REQUIRE_VLLM") == "1":  # the vLLM CI job: run these, never skip them
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm")

from kvfast.bugs.engines import VLLM_BUGS, first_acting_step, inject_vllm_bug  # noqa: E402
from kvfast.check import check_cache  # noqa: E402
from kvfast.check.engines.vllm import BLOCK, VLLMModel, tiny_vllm_model  # noqa: E402

pytestmark = pytest.mark.vllm
PROMPT = list(range(3, 43))  # 40 tokens: the resume's first chunk (20) and a prefill past one block of 32
LONG = list(range(3, 3 + 2 * BLOCK + 6))  # 70 tokens: the resume's first chunk fills a block (a prefix-cache hit)
STEPS = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_vllm_model(tmp_path_factory.mktemp("vllm-tiny"), seed=1)


@pytest.fixture(scope="module")
def engine(model_dir):
    return VLLMModel(model_dir, dtype="float32")


@pytest.fixture(scope="module")
def small_cache(model_dir):
    # 13 blocks of 32: four requests of LONG fit at their prefill (3 blocks each), not to the end of 32 decode steps
    return VLLMModel(model_dir, dtype="float32", kv_blocks=13)


@pytest.fixture(scope="module")
def engine_bf16(model_dir):
    return VLLMModel(model_dir, dtype="bfloat16")


def test_decode_is_one_request_of_vllm_and_equals_its_own_prefill_bit_for_bit(engine):
    rows = engine.prefill(PROMPT)
    assert np.array_equal(rows, engine.recompute(PROMPT))
    sent = engine.requests
    seq, decoded = list(PROMPT), []
    for _ in range(8):
        seq.append(int(np.argmax(rows[-1] if not decoded else decoded[-1])))
        decoded.append(engine.decode(seq[-1]))
    assert engine.requests == sent  # served by the running request: vLLM's own decode
    assert np.array_equal(np.stack(decoded), engine.recompute(seq)[len(PROMPT) :])
    # a token vLLM did not choose starts a new request over the prefix cache
    other = (int(np.argmax(decoded[-1])) + 1) % engine.vocab_size
    row = engine.decode(other)
    assert engine.requests == sent + 2 and np.array_equal(row, engine.recompute(seq + [other])[-1])


def test_resume_reads_a_real_prefix_cache_hit(engine):
    split = len(LONG) // 2
    engine.prefill(LONG[:split])
    rows = engine.extend(LONG[split:])
    assert engine.last_hit == split // BLOCK * BLOCK > 0  # the first chunk's full blocks, read from the cache
    assert np.array_equal(rows, engine.recompute(LONG)[split:])


@pytest.mark.parametrize("mode", ["exact", "control"])
def test_a_correct_engine_passes_in_float32(engine, mode):
    report = check_cache(engine, LONG, STEPS, mode=mode)
    assert report.verdict == ("exact" if mode == "exact" else "rounding"), report.format()
    assert set(report.scenarios) == {"decode", "resume"}
    # float32 GEMMs that do not change with the row count (the probe) run as vLLM runs them, with no note
    pinned = mode == "exact" and engine.row_count_effect() > 0
    assert engine.rows_pinned == (1 if pinned else None)
    assert any("CPU change with the row count" in n for n in report.notes) == pinned, report.notes
    assert not engine.llm.llm_engine.has_unfinished_requests()  # no request of the check left in the engine


def test_an_llm_object_is_accepted_and_a_bad_path_is_refused(engine, tmp_path):
    again = VLLMModel(engine.llm)
    assert again.vocab_size == engine.vocab_size and again.internal_formats == engine.internal_formats
    with pytest.raises(ValueError, match="^path: "):
        VLLMModel(tmp_path)
    for bad in (0, "one", 1.5):
        with pytest.raises(ValueError, match="^gemm_rows: .* allowed: 'auto', None .* or an integer >= 1"):
            VLLMModel(engine.llm, gemm_rows=bad)


class _OneAfterTheOther(VLLMModel):
    """The adapter with the checker's plan ignored: the decode and resume scenarios' requests one after the other."""

    def plan_check(self, prompt, split, steps, scenarios):
        pass


def _scenario_calls(model, plan: bool):
    """A check's cache-path calls on LONG (decode, then resume, each fed vLLM's own greedy tokens), with or without
    the checker's plan; every row returned, and the engine steps they took."""
    split = len(LONG) // 2
    engine, steps = model.llm.llm_engine, []
    step = engine.step
    engine.step = lambda: steps.append(1) or step()
    try:
        if plan:
            model.plan_check(np.array(LONG), split, STEPS, ("decode", "resume"))
        rows, hits = [], []
        decode = lambda: [model.prefill(LONG)]  # noqa: E731
        resume = lambda: [model.prefill(LONG[:split]), model.extend(LONG[split:])]  # noqa: E731
        for scenario in (decode, resume):  # each run in turn, its decodes before the next scenario
            first = scenario()
            rows += first
            hits.append(model.last_hit)
            last = first[-1][-1]
            for _ in range(STEPS):
                rows.append(model.decode(int(np.argmax(last))))
                last = rows[-1]
    finally:
        del engine.step  # the class's method again (an instance attribute holding a bound method is a cycle that
        # keeps the engine alive until a later garbage collection, whose vLLM teardown breaks the next file's engine)
    return rows, len(steps), hits


@pytest.mark.parametrize(("dtype", "gemm_rows"), [("float32", None), ("bfloat16", None), ("bfloat16", 1)])
def test_the_scenarios_in_flight_together_return_the_rows_of_requests_run_one_after_the_other(
    engine, engine_bf16, dtype, gemm_rows
):
    llm = (engine if dtype == "float32" else engine_bf16).llm
    together, steps, hit = _scenario_calls(VLLMModel(llm, gemm_rows=gemm_rows), plan=True)
    alone, steps_alone, hit_alone = _scenario_calls(VLLMModel(llm, gemm_rows=gemm_rows), plan=False)
    assert len(together) == len(alone) == 3 + 2 * STEPS
    for k, (a, b) in enumerate(zip(together, alone, strict=True)):
        assert np.array_equal(a, b), k  # bit for bit, every row
    assert hit == hit_alone == [0, len(LONG) // 2 // BLOCK * BLOCK]  # the resume read a real prefix-cache hit
    assert steps <= steps_alone - STEPS  # the two decoded in the same engine steps
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("mode", ["exact", "control"])
def test_a_check_with_the_scenarios_together_reports_what_it_reports_one_after_the_other(engine, mode):
    for bug in (None, "hitpos"):  # hitpos acts on the resume request, the one that runs with the decode request
        reports = [
            check_cache(inject_vllm_bug(cls(engine.llm), bug), LONG, STEPS, mode=mode, keep_logits=True)
            for cls in (VLLMModel, _OneAfterTheOther)
        ]
        assert reports[0].verdict == reports[1].verdict and reports[0].notes == reports[1].notes, bug
        for name, scenario in reports[0].scenarios.items():
            other = reports[1].scenarios[name]
            assert np.array_equal(scenario.cache_logits, other.cache_logits), (bug, name)
            assert np.array_equal(scenario.deviation, other.deviation), (bug, name)


def test_chunked_prefill_is_checked_against_the_unchunked_recompute(engine):
    chunked = VLLMModel(engine.llm, prefill_chunk=16)  # the cached path's prefills 16 tokens a step
    assert check_cache(chunked, LONG, STEPS, mode="exact").verdict == "exact"
    # a chunk over cached chunks placed one position early: the decode scenario's own prefill now has such chunks,
    # and the unchunked reference does not share the bug, so it is seen at the prefill (step 0) in both scenarios
    report = check_cache(
        inject_vllm_bug(VLLMModel(engine.llm, prefill_chunk=16), "hitpos"), LONG, STEPS, fast=False, mode="exact"
    )
    assert {k: v.first_divergent_step for k, v in report.scenarios.items()} == {"decode": 0, "resume": 0}


def test_requests_in_flight_together_and_forced_preemptions(small_cache):
    busy = VLLMModel(small_cache.llm, companions=3)  # three other requests in the same steps, sent first
    report = check_cache(busy, LONG, STEPS, mode="exact")
    assert report.verdict == "exact", report.format()
    assert busy.preemptions > 0  # the block budget preempted the cached path's request; its rows stay exact
    buggy = inject_vllm_bug(VLLMModel(small_cache.llm, companions=3), "evict")
    report = check_cache(buggy, LONG, STEPS, fast=False, mode="exact")
    assert {k: v.first_divergent_step for k, v in report.scenarios.items()} == {"decode": 1, "resume": 1}


@pytest.mark.parametrize("bug", sorted(VLLM_BUGS))
def test_every_catalogue_bug_is_found_at_its_first_acting_step_in_float32(engine, bug):
    model = inject_vllm_bug(VLLMModel(engine.llm), bug)
    report = check_cache(model, LONG, STEPS, mode="exact", fast=False)
    assert report.verdict == "divergent", report.format()
    for name, scenario in report.scenarios.items():
        assert scenario.first_divergent_step == first_acting_step(bug, name, len(LONG)), (name, report.format())
    control = check_cache(inject_vllm_bug(VLLMModel(engine.llm), bug), LONG, STEPS, mode="control")
    assert control.verdict == "bug", control.format()


def test_bfloat16_decode_equals_the_prefill_run_with_decode_shaped_gemms_bit_for_bit(engine_bf16):
    # vLLM's CPU GEMMs pick their kernel by row count (bfloat16 on AMX: up to 4 rows AVX-512, more AMX): a
    # decode row equals, bit for bit, the prefill whose linear layers run one row at a time (the "rows" variant)
    rows = engine_bf16.prefill(PROMPT)
    seq, decoded = list(PROMPT), [rows[-1]]
    for _ in range(STEPS):
        seq.append(int(np.argmax(decoded[-1])))
        decoded.append(engine_bf16.decode(seq[-1]))
    variants = engine_bf16.recompute_variants(seq)
    assert set(variants) | set(engine_bf16.skipped_variants) == {"batch", "chunk", "rows"}
    rows = variants.get("rows")
    if rows is None:  # a CPU whose GEMMs do not change with the row count (no AMX): the variant is left out, and
        # the one-row prefill it would run equals the recompute
        assert list(engine_bf16.skipped_variants) == ["rows"] and engine_bf16.row_count_effect() == 0
        rows = engine_bf16._rows(seq)
        assert np.array_equal(rows, engine_bf16.recompute(seq))
    assert np.array_equal(np.stack(decoded), rows[len(PROMPT) - 1 :])


def test_bfloat16_row_count_probe_pins_exact_mode_only_and_says_so(engine_bf16):
    units = engine_bf16.row_count_effect()  # this CPU's fact: the same rows through a GEMM alone vs among 8
    if units == 0:
        pytest.skip("vLLM's bfloat16 GEMMs do not change with the row count on this CPU: nothing to pin")
    effect = f"change with the row count by up to {units:g} bfloat16 unit"
    # control mode: vLLM's own arithmetic (the "rows" variant measures the row count's noise), no pin, no note
    control = check_cache(engine_bf16, LONG, STEPS, mode="control")
    assert control.verdict == "rounding" and engine_bf16.rows_pinned is None, control.format()
    assert not any(effect in n for n in control.notes)
    # exact mode (gemm_rows="auto"): every GEMM one row at a time on both paths, the size measured in the report
    auto = VLLMModel(engine_bf16.llm)
    exact = check_cache(auto, LONG, STEPS, mode="exact")
    assert exact.verdict == "exact" and auto.rows_pinned == 1, exact.format()
    assert any(effect in n and "one row at a time on both paths" in n for n in exact.notes), exact.notes
    # the unpinned exact check the user asked for: divergent, the reason in the report
    unpinned = check_cache(VLLMModel(engine_bf16.llm, gemm_rows=None), LONG, STEPS, mode="exact")
    assert unpinned.verdict == "divergent", unpinned.format()
    assert any(effect in n and "gemm_rows=None" in n for n in unpinned.notes), unpinned.notes
    # an explicit gemm_rows wins in either mode
    two = VLLMModel(engine_bf16.llm, gemm_rows=2)
    report = check_cache(two, LONG, STEPS, mode="control")
    assert two.rows_pinned == 2 and "gemm_rows=2" in report.notes[0], report.notes


@pytest.mark.parametrize("bug", ["short", "hitpos"])
def test_a_catalogue_bug_is_found_in_bfloat16_exact_mode_with_the_pin_and_is_no_rounding_in_control(engine_bf16, bug):
    exact = check_cache(inject_vllm_bug(VLLMModel(engine_bf16.llm), bug), LONG, STEPS, mode="exact", fast=False)
    assert exact.verdict == "divergent", exact.format()
    for name, scenario in exact.scenarios.items():
        assert scenario.first_divergent_step == first_acting_step(bug, name, len(LONG)), (name, exact.format())
    report = check_cache(inject_vllm_bug(VLLMModel(engine_bf16.llm), bug), LONG, STEPS, mode="control")
    assert report.verdict in ("bug", "inconclusive"), report.format()


def test_the_command_line_checks_a_bfloat16_engine_exactly(model_dir):
    prompt = ",".join(map(str, PROMPT))
    cmd = [sys.executable, "-m", "kvfast.cli", "check", "--engine", "vllm", str(model_dir), "--prompt", prompt,
           "--steps", str(STEPS), "--factory-arg", "dtype=bfloat16", "--mode", "exact"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "EXACT" in done.stdout.splitlines()[0]


@pytest.mark.slow
def test_long_context_is_reported_with_its_size_and_position(tmp_path):
    # 3,500 tokens: vLLM's prefill rows change with the sequence's total length (rows past 3,200, a few float32
    # units: within rounding, so not `length-dependent`), and a row over cached keys (a decode step, a resumed
    # chunk) differs from the prefill's by as much. Exact mode: divergent where it first shows, by how much;
    # control mode: rounding, the length dependence named with its size and rows, the chunk variant measuring
    # the cached keys' noise
    model = VLLMModel(tiny_vllm_model(tmp_path, seed=1, positions=4096), max_model_len=4096)
    prompt = [3 + (7 * i) % 250 for i in range(3500)]
    exact = check_cache(model, prompt, 4, mode="exact")
    assert exact.verdict == "divergent", exact.format()
    decode = exact.scenarios["decode"]
    assert decode.first_divergent_step == 1 and 0 < decode.deviation[1] < 1e-5, exact.format()  # position 3500
    control = check_cache(model, prompt, STEPS, mode="control")
    assert control.verdict == "rounding" and control.length_dependence is None, control.format()
    found = [n for n in control.notes if "recompute is not append-invariant" in n]
    where = re.search(r"by (\S+) at row (\d+); (\d+) rows differ, from row (\d+) to (\d+)", found[0] if found else "")
    assert where and 0 < float(where[1]) < 1e-5 and 1280 < int(where[4]) <= int(where[2]) < 3500, control.notes
    assert re.search(r"variant 'chunk' \(up to [1-9]", " ".join(control.notes)), control.notes
