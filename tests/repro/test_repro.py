"""kvfast.repro: a finding as a standalone reproducer that runs without kvfast, exits 1 while the bug is there
and 0 on a clean model; the injected catalogue bugs a script can carry; shrinking; known or new."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvfast.bugs import CATALOGUES  # noqa: E402
from kvfast.check.hf import HFModel  # noqa: E402
from kvfast.repro import check_case, find_case, write_reproducer  # noqa: E402
from kvfast.repro.patches import PATCHES, patch_for  # noqa: E402
from kvfast.repro.shrink import shrink_case  # noqa: E402
from kvfast.testing import tiny_model  # noqa: E402

#: Runs scripts in one interpreter with kvfast made unimportable (``sys.modules['kvfast'] = None``), in isolated
#: mode (no PYTHONPATH, no current directory on sys.path): what they import must be torch and transformers only.
#: Each script's output ends with a line ``== exit CODE`` (one interpreter for several: torch loads once).
NO_KVFAST = """
import runpy, sys
sys.modules['kvfast'] = None
for path in sys.argv[1:]:
    sys.argv = [path]
    try:
        runpy.run_path(path, run_name='__main__')
        code = 0
    except SystemExit as exc:
        code = exc.code
    print(f'== exit {code}', flush=True)
"""
PROMPT = np.array([5, 17, 42, 8])
CONTINUATION = np.array([3, 61, 9, 27, 33, 70, 12, 4, 88, 1, 50, 23])


def run_scripts(*paths) -> list[tuple[int, str]]:
    """``(exit code, output)`` of each script, run without kvfast (:data:`NO_KVFAST`)."""
    done = subprocess.run(
        [sys.executable, "-I", "-c", NO_KVFAST, *map(str, paths)], capture_output=True, text=True, timeout=600
    )
    parts = re.split(r"^== exit (\S+)\n", done.stdout, flags=re.M)
    assert len(parts) == 2 * len(paths) + 1, done.stdout + done.stderr
    return [(int(parts[2 * i + 1]), parts[2 * i]) for i in range(len(paths))]


def first_differing_step(out: str) -> int | None:
    found = re.search(r"^first differing step: (\d+) ", out, re.M)
    return None if found is None else int(found.group(1))


@pytest.mark.subprocess
def test_the_guard_makes_kvfast_unimportable(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import kvfast\n")
    done = subprocess.run([sys.executable, "-I", "-c", NO_KVFAST, str(script)], capture_output=True, text=True)
    assert done.returncode == 1 and "import of kvfast halted" in done.stderr


def _case(family, bug, scenario, tmp_path, seed=0, static=False):
    from transformers import StaticCache

    model = tiny_model(family, seed=seed)
    adapter = HFModel(model, new_cache=(lambda: StaticCache(config=model.config, max_cache_len=32)) if static else None)
    if bug is not None:
        adapter = CATALOGUES[bug[0]][bug[1]].inject(adapter)
    case = find_case(
        adapter, PROMPT, scenario, continuation=CONTINUATION, seed=seed, command="tests/repro/test_repro.py"
    )
    return case, write_reproducer(case, tmp_path / "repro")


@pytest.mark.subprocess
def test_findings_reproduce_without_kvfast_and_a_clean_model_exits_0(tmp_path):  # the issue's proof: by default
    """An injected bug (the script carries it), a finding of the library itself (Mamba's resume: no patch) and
    a clean model asked for on purpose: exit 1, 1 and 0; the script's per-step deviations are kvfast's, digit
    for digit as printed (the same calls, the same recompute rows)."""
    from kvfast.studies.architectures import tiny_architecture

    posoff, posoff_script = _case("llama", ("hf", "posoff"), "decode", tmp_path / "posoff")
    assert posoff.verdict == "bug" and posoff.first_bug_step == 1 and posoff.bug == ("hf", "posoff")
    assert "INJECTED BUG" in posoff_script.read_text()
    mamba = find_case(tiny_architecture("mamba", "float32", "auto", 0), PROMPT, "resume", continuation=CONTINUATION[:6])
    assert mamba.verdict == "bug" and mamba.bug is None
    mamba_script = write_reproducer(mamba, tmp_path / "mamba")
    clean, clean_script = _case("llama", None, "decode", tmp_path / "clean")
    assert clean.verdict == "rounding" and clean.bug is None
    shrunk = shrink_case(posoff, seconds=60)
    assert check_case(shrunk.case).scenarios["decode"].verdict == "bug"  # kvfast still calls the shrunk case a bug
    assert shrunk.case.config["num_hidden_layers"] == 1 and shrunk.case.steps == 1 and len(shrunk.case.prompt) < 4
    assert shrunk.case.config["hidden_size"] < posoff.config["hidden_size"] and shrunk.case.bug == posoff.bug
    shrunk_script = write_reproducer(shrunk.case, tmp_path / "shrunk")
    runs = run_scripts(posoff_script, mamba_script, clean_script, shrunk_script)
    (code, out), (mamba_code, mamba_out), (clean_code, clean_out), (shrunk_code, shrunk_out) = runs
    assert shrunk_code == 1 and first_differing_step(shrunk_out) == shrunk.case.first_bug_step
    assert code == 1 and first_differing_step(out) == 1
    assert "versions: python" in out and "transformers" in out
    assert mamba_code == 1 and first_differing_step(mamba_out) == mamba.first_bug_step
    rows = re.findall(r"^\s+(\d+)\s+[\d-]+\s+(\S+)\s+\S+", mamba_out, re.M)
    assert [float(d) for _, d in rows] == [float(f"{d:.6g}") for d in mamba.deviation]
    issue = (tmp_path / "mamba" / "ISSUE.md").read_text()
    assert "Label: **known**" in issue and "resume" in issue
    assert clean_code == 0 and first_differing_step(clean_out) is None and "no bug shown" in clean_out


def test_shrinking_reports_what_it_could_not_shrink_and_refuses_a_case_without_a_bug(tmp_path):
    """Mamba's resume: the prompt cannot lose a token (a 2-token resume is rounding), which the result says."""
    from kvfast.studies.architectures import tiny_architecture

    model = tiny_architecture("mamba", "float32", "auto", 0)
    case = find_case(model, PROMPT, "resume", continuation=CONTINUATION[:4])
    shrunk = shrink_case(case, seconds=60)
    assert shrunk.case.verdict == "bug" and shrunk.case.steps == 1
    assert any(line.startswith("prompt start 3 tokens -> 2 tokens: kvfast calls it") for line in shrunk.not_shrunk)
    clean = find_case(HFModel(tiny_model("llama")), PROMPT, "decode", continuation=CONTINUATION[:2])
    with pytest.raises(ValueError, match="case: verdict 'rounding' is not allowed; allowed: a case kvfast calls"):
        shrink_case(clean)
    with pytest.raises(ValueError, match="seconds: 0 is not allowed"):
        shrink_case(case, seconds=0)


def test_a_bug_no_script_carries_is_refused_by_name():
    with pytest.raises(ValueError, match="bug: 'operations:static_never_cleared' is not allowed; allowed: .*hf:posoff"):
        patch_for(("operations", "static_never_cleared"))


CARRIED = {
    ("hf", "posoff"): ("llama", "decode"),
    ("hf", "restart"): ("llama", "resume"),
    ("hf", "replay"): ("llama", "resume"),
    ("hf", "window"): ("llama", "decode"),
    ("hf", "freeze"): ("llama", "decode"),
    ("hf", "f16"): ("llama", "decode"),
    ("operations", "crop_short"): ("llama", "rollback"),
    ("operations", "window_evicts_one_too_many"): ("mistral", "decode"),
    ("operations", "fork_shared_keys"): ("llama", "fork"),  # a StaticCache: it writes its keys in place
    ("operations", "reorder_wrong_index"): ("llama", "reorder"),
    ("operations", "reorder_keys_only"): ("llama", "reorder-beam"),
    ("operations", "padded_positions_from_start"): ("gpt2", "padded-row"),  # absolute positions
}
#: The bugs that act only on a cache that writes in place (a StaticCache).
STATIC = {("operations", "fork_shared_keys")}


def test_every_patch_has_a_case():
    assert set(CARRIED) == set(PATCHES)


@pytest.mark.slow
def test_every_carried_catalogue_bug_shrinks_to_a_reproducer_without_kvfast(tmp_path):
    """Every bug a script carries (both catalogues): found, shrunk (kvfast still calls the shrunk case a bug, and
    it is no larger), and both scripts, run without kvfast, exit 1 at kvfast's first bug step."""
    cases, scripts = [], []
    for bug, (family, scenario) in CARRIED.items():
        case, script = _case(family, bug, scenario, tmp_path / bug[1], static=bug in STATIC)
        assert case.verdict == "bug", (bug, case.verdict)
        shrunk = shrink_case(case, seconds=20).case
        assert check_case(shrunk).scenarios[scenario].verdict == "bug" and shrunk.bug == bug
        assert shrunk.steps <= case.steps and len(shrunk.prompt) <= len(case.prompt), bug
        cases += [case, shrunk]
        scripts += [script, write_reproducer(shrunk, tmp_path / f"{bug[1]}-shrunk")]
    for case, (code, out) in zip(cases, run_scripts(*scripts), strict=True):
        assert code == 1 and first_differing_step(out) == case.first_bug_step, (case.bug, out)


def test_known_or_new_labels_follow_the_registry():
    from kvfast.repro.known import label

    known, reference = label("transformers", "5.24.0", "mamba", "resume")
    assert known == "known" and "docs/check.md" in reference
    assert label("transformers", "5.24.0", "mamba", "decode") == ("new", None)  # another scenario: not in it
    assert label("transformers", "4.46.3", "gemma2", "decode")[0] == "known"
    assert label("transformers", "5.24.0", "gemma2", "decode") == ("new", None)  # gone in 4.57.6
    assert label("transformers", "5.24.0", "mamba", "resume", injected=True)[0] == "injected"


def test_the_findings_list_new_first():
    from kvfast.repro.findings import Finding, findings_table

    rows = [
        Finding("a", "float32", "decode", "hf:posoff", "injected", None, 1, "x"),
        Finding("b", "float32", "resume", "none", "known", "ref", 0, "y"),
        Finding("c", "float32", "decode", "none", "new", None, 3, "z"),
    ]
    assert list(findings_table(rows)["label"]) == ["new", "known", "injected"]


BUGGY = """
from kvfast.bugs.hf import inject_hf_bug
from kvfast.check.hf import HFModel
from kvfast.testing import tiny_model


def buggy(seed=0):
    return inject_hf_bug(HFModel(tiny_model("llama", seed=seed)), "posoff")
"""


@pytest.mark.slow  # over 20 s on the loaded 2-core machine (a kvfast-free interpreter loads torch)
def test_kvfast_check_repro_writes_a_reproducer_per_failing_scenario(tmp_path):
    import os
    from pathlib import Path

    import kvfast

    (tmp_path / "buggy_factory.py").write_text(BUGGY)
    env = {**os.environ, "PYTHONPATH": str(Path(kvfast.__file__).resolve().parents[1])}
    args = ["check", "buggy_factory:buggy", "--prompt", "5,17,42,8", "--steps", "4", "--mode", "control"]
    args += ["--scenarios", "decode", "--repro", str(tmp_path / "out"), "--repro-seconds", "5"]
    done = subprocess.run(
        [sys.executable, "-m", "kvfast.cli", *args], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 1, done.stdout + done.stderr
    script = tmp_path / "out" / "decode" / "reproduce.py"
    assert f"reproducer, decode: {script} (injected" in done.stdout
    assert script.exists() and (tmp_path / "out" / "decode" / "ISSUE.md").exists()
    assert "kvfast check buggy_factory:buggy" in script.read_text()
    bad = subprocess.run(
        [sys.executable, "-m", "kvfast.cli", *args[:-1], "0"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--repro-seconds: 0 is not allowed" in bad.stderr


@pytest.mark.subprocess
def test_a_scan_writes_its_bug_rows_reproducers_beside_the_results(tmp_path):
    import pandas as pd

    from kvfast.studies.scan_repro import bug_rows, repro_dir, write_scan_reproducers

    base = dict(dtype="float32", attention="auto", seed=0, prompt=0, steps=4, first_bug_step=0)
    df = pd.DataFrame(
        [
            {**base, "architecture": "mamba", "scenario": "resume", "bug": "none", "verdict": "bug"},
            {**base, "architecture": "mamba", "scenario": "resume", "bug": "none", "verdict": "bug", "prompt": 1},
            {**base, "architecture": "llama", "scenario": "decode", "bug": "posoff", "verdict": "bug"},
            {**base, "architecture": "llama", "scenario": "decode", "bug": "none", "verdict": "rounding"},
        ]
    )
    assert len(bug_rows(df, "findings")) == 1 and len(bug_rows(df, "all")) == 2
    results = tmp_path / "scan"
    table = write_scan_reproducers(df, results, "findings", seconds=5)
    assert repro_dir(results) == tmp_path / "scan.repro" and not results.exists()
    assert list(table["label"]) == ["known"] and list(table["architecture"]) == ["mamba"]
    assert (tmp_path / "scan.repro" / "mamba-float32-resume-none" / "reproduce.py").exists()
    assert (tmp_path / "scan.repro" / "findings.csv").exists()


def test_a_cache_no_script_builds_is_refused_by_name():
    from transformers import DynamicCache

    class OwnCache(DynamicCache):
        pass

    model = tiny_model("llama")
    adapter = HFModel(model, new_cache=lambda: OwnCache(config=model.config))
    with pytest.raises(ValueError, match="model: .*OwnCache' is not allowed; allowed: a DynamicCache, StaticCache or"):
        find_case(adapter, PROMPT, "decode", continuation=CONTINUATION[:2])


@pytest.mark.slow  # over 20 s on the loaded 2-core machine (scripts in a kvfast-free interpreter)
def test_the_cache_operations_reproduce_without_kvfast_clean_and_bugged(tmp_path):
    """fork (on a StaticCache, with its bug fork_shared_keys), reorder (both beams), padded (both rows): each
    script's exit code is kvfast's verdict, its first differing step kvfast's first bug step, and its per-step
    deviations kvfast's, digit for digit as printed; a reorder bug shrunk is still a bug and still shown."""
    cases = [
        _case("llama", None, "fork", tmp_path / "fork", static=True),
        _case("llama", None, "reorder-beam", tmp_path / "beam"),
        _case("gpt2", None, "padded", tmp_path / "padded"),
        _case("llama", ("operations", "fork_shared_keys"), "fork", tmp_path / "shared", static=True),
        _case("gpt2", ("operations", "padded_positions_from_start"), "padded-row", tmp_path / "row"),
    ]
    wrong, _ = _case("llama", ("operations", "reorder_wrong_index"), "reorder", tmp_path / "wrong")
    assert [c.verdict for c, _ in cases] == ["rounding", "rounding", "rounding", "bug", "bug"]
    assert cases[0][0].calls["cache_class"] == "StaticCache" and cases[1][0].branch_tokens
    shrunk = shrink_case(wrong, seconds=30)
    assert check_case(shrunk.case).scenarios["reorder"].verdict == "bug" and shrunk.case.steps <= wrong.steps
    shrunk_script = write_reproducer(shrunk.case, tmp_path / "wrong-shrunk")
    runs = run_scripts(*(script for _, script in cases), shrunk_script)
    for (case, _), (code, out) in zip(cases, runs, strict=False):
        assert code == (1 if case.verdict == "bug" else 0), (case.scenario, out)
        assert first_differing_step(out) == case.first_bug_step, (case.scenario, out)
        rows = re.findall(r"^\s+(\d+)\s+[\d-]+\s+(\S+)\s+\S+", out, re.M)
        assert [float(d) for _, d in rows] == [float(f"{d:.6g}") for d in case.deviation], case.scenario
    code, out = runs[-1]
    assert code == 1 and first_differing_step(out) == shrunk.case.first_bug_step == 2


@pytest.mark.slow  # over 20 s on the loaded 2-core machine (scripts in a kvfast-free interpreter)
def test_a_finding_only_the_logic_check_shows_reproduces_in_float64(tmp_path):
    """FalconMamba's bfloat16 resume: its own verdict is inconclusive (the difference hides in bfloat16's
    rounding), the float64 logic check says bug. The case is the logic check's (the bfloat16 model promoted), its
    weights still a seed's; the script, without kvfast, runs it in float64, says so, and exits 1 at kvfast's step
    with kvfast's deviations. The scan lists such a row (and prefers a native bug row of the same cell)."""
    import pandas as pd

    from kvfast.check.checker import check_cache
    from kvfast.studies.architectures import tiny_architecture
    from kvfast.studies.scan_repro import bug_rows

    model = tiny_architecture("falcon_mamba", "bfloat16", "auto", 0)
    native = check_cache(
        HFModel(model), PROMPT, mode="control", scenarios=("resume",), continuation=CONTINUATION[:4], promote="float64"
    )
    assert native.native_verdict != "bug" and native.promoted.verdict == "bug" and native.verdict == "bug"
    case = find_case(model, PROMPT, "resume", continuation=CONTINUATION[:4], promote="float64")
    assert case.verdict == "bug" and case.dtype == "bfloat16" and case.promote == "float64" and case.weights is None
    assert check_case(case).scenarios["resume"].verdict == "bug"
    script = write_reproducer(case, tmp_path / "logic")
    assert "precision: a finding of kvfast's logic check" in (tmp_path / "logic" / "ISSUE.md").read_text()
    ((code, out),) = run_scripts(script)
    assert code == 1 and "run in float64: the model's weights are bfloat16's" in out
    assert first_differing_step(out) == case.first_bug_step
    rows = re.findall(r"^\s+(\d+)\s+[\d-]+\s+(\S+)\s+\S+", out, re.M)
    assert [float(d) for _, d in rows] == [float(f"{d:.6g}") for d in case.deviation]
    base = dict(architecture="falcon_mamba", dtype="bfloat16", attention="auto", scenario="resume", bug="none",
                steps=4, seed=0, promote="float64", first_bug_step=-1)  # fmt: skip
    df = pd.DataFrame(
        [
            {**base, "prompt": 0, "verdict": "inconclusive", "logic_verdict": "bug"},
            {**base, "prompt": 1, "verdict": "rounding", "logic_verdict": "rounding"},
        ]
    )
    assert list(bug_rows(df)["prompt"]) == [0]
    both = pd.concat([df, pd.DataFrame([{**base, "prompt": 2, "verdict": "bug", "logic_verdict": "bug"}])])
    assert list(bug_rows(both)["prompt"]) == [2]  # a native bug row first
    clean = df.assign(logic_verdict="rounding")
    assert not len(bug_rows(clean))


def test_a_check_reproduces_a_second_branch_with_its_scenario_s_tokens(tmp_path):
    """kvfast check --repro's function on a reorder whose bug shows in both beams: one reproducer per report, each
    case with the main beam's tokens (what the check fed) and the second beam's, and judging its own."""
    import json

    from kvfast.check.checker import check_cache
    from kvfast.repro.findings import reproduce_report

    adapter = CATALOGUES["operations"]["reorder_wrong_index"].inject(HFModel(tiny_model("llama")))
    report = check_cache(adapter, PROMPT, mode="control", scenarios=("reorder",), continuation=CONTINUATION[:4])
    assert {n: s.verdict for n, s in report.scenarios.items()} == {"reorder": "bug", "reorder-beam": "bug"}
    found = reproduce_report(adapter, PROMPT, report, tmp_path, seconds=0)
    assert sorted(f.scenario for f in found) == ["reorder", "reorder-beam"] and all(f.reproducer for f in found)
    for name in ("reorder", "reorder-beam"):
        case = json.loads((tmp_path / name / "case.json").read_text())
        assert case["scenario"] == name and case["tokens"] == report.scenarios["reorder"].tokens.tolist()
        assert case["branch_tokens"] == report.scenarios["reorder-beam"].tokens.tolist()
        assert case["deviation"] == report.scenarios[name].deviation.tolist()
    assert "JUDGED = 'branch'" in (tmp_path / "reorder-beam" / "reproduce.py").read_text()


#: A program run with a copy of kvfast first on its path: the decode of a clean tiny Llama's case, its reproducer
#: written to argv[2] (its verdict printed).
FROM_COPY = """
import sys
import numpy as np
import kvfast
from kvfast.check.hf import HFModel
from kvfast.testing import tiny_model
from kvfast.repro import find_case, write_reproducer

assert kvfast.__file__.startswith(sys.argv[1]), kvfast.__file__
case = find_case(HFModel(tiny_model("llama")), np.array([5, 17]), "decode", continuation=np.array([3]))
write_reproducer(case, sys.argv[2])
print(case.verdict, case.first_bug_step)
"""
#: An edit of the shared cached path (kvfast/check/hf_path.py): the decoded token's position_ids one ahead.
EDIT = ("positions = self._decode_positions()", "positions = [self.length + 1]  # edited in a copy")


def test_the_checker_and_a_reproducer_run_one_cached_path_source(tmp_path, capsys):
    """The cached path is written once (kvfast.check.hf_path): edited in a copy of kvfast, both the checker's
    HFModel (its verdict) and a reproducer written by that copy change with it; the controls, the unedited kvfast's
    verdict and the same case rendered by it, are clean (the scripts run here: they import no kvfast)."""
    import os
    import runpy
    import shutil
    from pathlib import Path

    import kvfast
    from kvfast.check import check_cache
    from kvfast.repro.case import ReproCase
    from kvfast.repro.script import render

    copy = tmp_path / "copy"
    shutil.copytree(Path(kvfast.__file__).parent, copy / "kvfast", ignore=shutil.ignore_patterns("__pycache__"))
    shared = copy / "kvfast" / "check" / "hf_path.py"
    assert shared.read_text().count(EDIT[0]) == 1
    shared.write_text(shared.read_text().replace(*EDIT))
    env = {**os.environ, "PYTHONPATH": str(copy)}
    done = subprocess.run(
        [sys.executable, "-c", FROM_COPY, str(copy), str(tmp_path / "edited")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.split() == ["bug", "1"], done.stdout + done.stderr
    control = check_cache(HFModel(tiny_model("llama")), [5, 17], mode="control", scenarios="decode", continuation=[3])
    assert control.verdict == "rounding", control.format()
    edited = tmp_path / "edited" / "reproduce.py"
    unedited = tmp_path / "unedited.py"
    unedited.write_text(render(ReproCase.from_json((tmp_path / "edited" / "case.json").read_text())))
    assert EDIT[1] in edited.read_text() and EDIT[1] not in unedited.read_text()
    runs = []
    for script in (edited, unedited):
        with pytest.raises(SystemExit) as exited:
            runpy.run_path(str(script), run_name="__main__")
        runs.append((exited.value.code, capsys.readouterr().out))
    (code, out), (clean, clean_out) = runs
    assert code == 1 and first_differing_step(out) == 1, out
    assert clean == 0 and first_differing_step(clean_out) is None, clean_out
