"""``kvfast report``: the page, its tables and the Markdown, from small stored results of every study."""

from __future__ import annotations

import html
import re

import numpy as np
import pandas as pd
import pytest
from shared import HF, HF_SMALL_GRIDS

from kvfast.bugs.score import roc_auc
from kvfast.cli import main
from kvfast.report.claims import claims_markdown, claims_table, counts, facts, load_results
from kvfast.report.page import matplotlib_available, render, sections, write_tables
from kvfast.studies import STUDIES
from kvfast.studies.detector import roc_points

SMALL_GRIDS = {
    "exactness": """
[fixed]
vocab = 11
d_model = 8
d_ff = 12
n_layer = 1
n_head = 2
prompt_len = 3
steps = 4
order = "sequential"
[axes]
seed = [0, 1]
preset = ["f64"]
""",
    "bugs": """
[fixed]
model = "random"
vocab = 32
d_model = 16
d_ff = 32
n_layer = 1
n_head = 2
prompt_len = 10
steps = 16
preset = "f64"
seed = 0
[axes]
bug = ["stale", "freeze", "evict"]
""",
    "detector": """
[fixed]
model = "random"
vocab = 32
d_model = 16
d_ff = 32
n_layer = 1
n_head = 1
steps = 16
preset = "f64"
[axes]
bug = ["posoff", "posfrozen", "none"]
[[tied]]
seed = [10, 14]
prompt_len = [3, 14]
""",
    "invariance": """
[fixed]
vocab = 11
d_model = 8
d_ff = 12
n_layer = 2
n_head = 2
seed = 0
prompt_len = 4
preset = "f64"
[axes]
causal = [true, false]
""",
    "precision": """
[fixed]
vocab = 11
n_layer = 1
n_head = 2
d_model = 8
d_ff = 12
prompt_len = 4
steps = 4
seed = 0
storage = "bf16"
attention = "standard"
decode_attention = "same"
[axes]
accum = ["f64", "bf16"]
prefill_order = ["sequential", "pairwise"]
""",
    "neartied": """
[fixed]
model = "random"
n_layer = 1
n_head = 2
d_model = 8
d_ff = 12
vocab = 12
prompt_len = 4
steps = 6
prefill_order = "sequential"
storage = "bf16"
twin_exp = 8
[axes]
accum = ["f32", "bf16"]
seed = [0, 1]
""",
    "training": """
[fixed]
n_layer = 1
n_head = 1
d_model = 8
d_ff = 8
vocab = 8
batch = 2
lr = 0.01
grad_batch = 2
eval_size = 4
train_steps = 2
seed = 0
[axes]
prefix_len = [0, 6]
""",
    "gradcheck": """
[fixed]
n_layer = 1
n_head = 1
d_model = 4
d_ff = 4
vocab = 5
seq_len = 3
seed = 0
""",
    "check": """
[fixed]
factory = "kvfast.studies.check:kvfast_model"
n_layer = 1
n_head = 1
d_model = 8
d_ff = 8
vocab = 8
preset = "f64"
order = "sequential"
attention = "standard"
prompt_seed = 0
prompt_len = 3
steps = 3
scenarios = "decode"
promote = "none"
seed = 0
[axes]
bug = ["none", "posfrozen"]
mode = ["exact"]
""",
}


# The Hugging Face studies need kvfast[hf]: their small grids run where it is installed (always in CI).
HF_GRIDS = {
    **HF_SMALL_GRIDS,  # tests/studies/test_studies_hf.py: 3 runs each
    "hf_scan": """
[fixed]
architecture = "llama"
scenario = "decode"
dtype = "float32"
promote = "none"
mode = "auto"
attention = "auto"
seed = 0
prompt = 0
steps = 4
[axes]
bug = ["none", "posoff"]
""",
    "engines": """
[fixed]
engine = "transformers"
weights = "f32"
cache = "native"
seed = 0
prompt = 0
steps = 4
[axes]
bug = ["none", "evict"]
""",
}
if HF:
    SMALL_GRIDS.update(HF_GRIDS)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A folder of results directories, one per study, each from a small grid (as `kvfast reproduce` lays out)."""
    root = tmp_path_factory.mktemp("results")
    for name, body in SMALL_GRIDS.items():
        toml = root.parent / f"{name}.toml"
        toml.write_text(f'study = "{name}"\n{body}')
        assert main(["run", str(toml), "--out", str(root / name), "--jobs", "1", "--quiet"]) == 0
    return root


def test_every_study_has_a_small_grid_here():
    assert set(SMALL_GRIDS) | set(HF_GRIDS) == set(STUDIES)


def test_report_command_writes_a_self_contained_page_and_its_tables(stored, tmp_path, capsys):
    out = tmp_path / "rep"
    assert main(["report", str(stored), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"report: {out / 'report.html'}"
    page = (out / "report.html").read_text()
    results = load_results(stored)
    assert set(results) == set(SMALL_GRIDS)
    table = claims_table(results)
    c = counts(table)
    assert f"{c['claims_hold']} of {c['claims']} claims hold." in page
    assert f"Verifier: {c['conditions_hold']} of {c['conditions']} assertions" in page
    for claim in table["claim"]:
        assert html.escape(claim) in page
    assert "http://" not in page and "https://" not in page  # nothing to fetch
    assert not re.search(r'src="(?!data:)', page)  # every image inline
    titles = [s.figure.title for s in sections(results)]
    # training: cosine vs prefix, during training, per tensor, final losses, loss curves; every other study one,
    # the detector two (ROC, steps to detection); the Hugging Face studies (and the engines study) one each
    assert len(titles) == 14 + len(HF_GRIDS) * HF
    assert not [s.figure.key for s in sections(results) if s.figure.note]  # every figure's numbers are stored now
    for title in titles:
        assert html.escape(title) in page
    if matplotlib_available():
        assert page.count('src="data:image/png;base64,') == len(titles)
    written = pd.read_csv(out / "claims.csv", keep_default_na=False)
    assert list(written["claim"]) == list(table["claim"])
    extra = {"detector_steps", *(["hf_matrix_bugs", "hf_scan_bugs", "hf_scan_skipped"] if HF else [])}
    assert {p.stem for p in (out / "summaries").glob("*.csv")} == {*SMALL_GRIDS, *extra}
    for name in {*SMALL_GRIDS, *extra}:  # each summary table on the page too (hf_scan_skipped among them)
        assert f"<summary>{name} (" in page, name


def test_without_matplotlib_every_figure_is_a_table_with_a_note(stored):
    results = load_results(stored)
    page = render(results, plots=False)
    assert "<img" not in page
    assert "matplotlib is not installed" in page
    for sec in sections(results):
        assert html.escape(sec.figure.title) in page


def test_markdown_prints_the_claims_table_and_its_count(stored, capsys):
    assert main(["report", str(stored), "--markdown"]) == 0
    text = capsys.readouterr().out.strip()
    table = claims_table(load_results(stored))
    assert text == claims_markdown(table)
    lines = text.splitlines()
    assert lines[0] == "| study | claim | seed | kvfast | holds | criterion |"
    assert sum(1 for line in lines if line.startswith("| ")) == len(table) + 1
    c = counts(table)
    assert lines[-1].startswith(f"{c['claims_hold']} of {c['claims']} claims hold; verifier: ")
    for what in ("facts", "tables"):
        assert main(["report", str(stored), "--markdown", what]) == 0
        out = capsys.readouterr().out
        assert out.startswith(("| figure |", "#### bugs"))
        if HF and what == "facts":  # the Hugging Face studies' facts (their grids: tests/studies/test_studies_hf.py)
            assert "hf_matrix study: clean runs" in out and "hf_score study, float32 sdpa" in out


def test_tables_are_the_same_bytes_when_written_twice(stored, tmp_path):
    results = load_results(stored)
    a = write_tables(results, tmp_path / "a")
    b = write_tables(load_results(stored), tmp_path / "b")
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    assert len(facts(results))


def test_bad_results_dir_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "RESULTS_DIR:" in err and "is not allowed" in err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "RESULTS_DIR:" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [[], ["--no-html"]])
def test_report_of_a_results_dir_goes_beside_it_and_the_dataset_still_reads(stored, tmp_path, capsys, flags):
    """Issue 23, finding 12: `kvfast report DIR` wrote DIR/report/, and pd.read_parquet(DIR) then failed."""
    import shutil

    import pyarrow.dataset as ds

    one = tmp_path / "exactness"
    shutil.copytree(stored / "exactness", one)
    before = pd.read_parquet(one)
    assert main(["report", str(one), *flags]) == 0
    printed = capsys.readouterr().out
    assert str(tmp_path / "exactness.report") in printed and (tmp_path / "exactness.report" / "claims.csv").is_file()
    assert sorted(p.name for p in one.iterdir() if not p.name.startswith(("_", "."))) == sorted(
        p.name for p in (stored / "exactness").iterdir() if not p.name.startswith(("_", "."))
    )
    assert pd.read_parquet(one).equals(before)
    assert ds.dataset(one, format="parquet").to_table().num_rows == len(before)
    # --out inside a results directory is refused with one line, nothing written
    assert main(["report", str(one), *flags, "--out", str(one / "report")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out:" in err and "inside the results directory" in err
    assert not (one / "report").exists() and pd.read_parquet(one).equals(before)


def test_unwritable_out_is_one_line_and_exit_2(stored, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["report", str(stored), "--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out:" in err and "allowed: a writable directory" in err


@pytest.mark.parametrize("seed", range(6))
def test_roc_points_enclose_the_mann_whitney_auc(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(4, 50))
    labels = rng.random(n) < 0.5
    labels[:2] = [True, False]
    scores = rng.integers(0, 4, size=n).astype(float) if seed % 2 else rng.standard_normal(n)
    fpr, tpr = roc_points(scores, labels)
    assert (fpr[0], tpr[0], fpr[-1], tpr[-1]) == (0.0, 0.0, 1.0, 1.0)
    assert (np.diff(fpr) >= 0).all() and (np.diff(tpr) >= 0).all()
    area = float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2))
    assert area == pytest.approx(roc_auc(scores, labels), abs=1e-12)
