"""Studies own their presentation: the report walks the registry and shows what each study declares.

A toy study registered here (a figure, a fact and a table of its own, declared
beside its run function) is run, stored and reported without any change to
``kvfast/report/``; the report's source names no study and imports nothing from one.
"""

from __future__ import annotations

import ast
import html
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest

import kvfast.report
from kvfast.cli import main
from kvfast.report.claims import facts, load_results
from kvfast.report.page import matplotlib_available, ordered_studies, render, sections, summaries
from kvfast.studies import STUDIES
from kvfast.studies.common import ok_rows
from kvfast.studies.plotting import pyplot
from kvfast.sweep.study import Fact, Figure, Study

# --- a toy study: everything the report shows of it is declared here ----------------------------------------


def _run(config: dict) -> dict:
    return {"y": 2.0 * config["x"] + 1.0}


def _validate(config: dict) -> None:
    if not isinstance(config.get("x"), int):
        raise ValueError(f"x: {config.get('x')!r} is not allowed; allowed: an integer")


def _summarize(df: pd.DataFrame) -> pd.DataFrame:
    return ok_rows(df)[["x", "y"]].sort_values("x").reset_index(drop=True)


def _line_table(df: pd.DataFrame) -> pd.DataFrame:
    return _summarize(df).assign(slope=2.0)


def _draw_line(df: pd.DataFrame, table: pd.DataFrame):
    fig, ax = pyplot().subplots(figsize=(3, 2))
    ax.plot(table["x"], table["y"], "-o")
    return fig


def _facts(df: pd.DataFrame) -> list[Fact]:
    return [Fact("toy_largest_y", "toy study: the largest y", f"{ok_rows(df)['y'].max():g}")]


TOY = Study(
    name="toy",
    version="1",
    description="y = 2x + 1",
    run=_run,
    config_fields={"x": pa.int64()},
    result_fields={"y": pa.float64()},
    validate_config=_validate,
    summarize=_summarize,
    figures=(Figure("toy_line", "Toy: y against x", "The toy's line, one point per run.", _line_table, _draw_line),),
    facts=_facts,
    tables=(("toy_even", lambda df: _summarize(df).query("x % 2 == 0").reset_index(drop=True)),),
    rank=0,
)


@pytest.fixture
def toy_results(tmp_path, monkeypatch):
    """The toy study registered, run by `kvfast run` from its grid and stored as `kvfast reproduce` lays out."""
    monkeypatch.setitem(STUDIES, "toy", TOY)
    grid = tmp_path / "toy.toml"
    grid.write_text('study = "toy"\n[axes]\nx = [1, 2, 3, 4]\n')
    root = tmp_path / "results"
    assert main(["run", str(grid), "--out", str(root / "toy"), "--jobs", "1", "--quiet"]) == 0
    return root


def test_a_registered_toy_study_is_reported_with_its_figure_fact_and_table(toy_results, tmp_path, capsys):
    out = tmp_path / "rep"
    assert main(["report", str(toy_results), "--out", str(out)]) == 0
    capsys.readouterr()
    page = (out / "report.html").read_text()
    for text in ("Toy: y against x", "The toy&#x27;s line, one point per run.", 'id="toy_line"'):
        assert text in page
    if matplotlib_available():
        assert page.count('src="data:image/png;base64,') == 1
    written = pd.read_csv(out / "facts.csv", keep_default_na=False, dtype=str)
    row = written[written["key"] == "toy_largest_y"]
    assert list(row["value"]) == ["9"] and list(row["study"]) == ["toy"]
    assert list(pd.read_csv(out / "summaries" / "toy_even.csv")["x"]) == [2, 4]
    results = load_results(toy_results)
    assert [s.figure.key for s in sections(results)] == ["toy_line"]
    assert list(sections(results)[0].table["y"]) == [3.0, 5.0, 7.0, 9.0]
    assert list(summaries(results)) == ["toy", "toy_even"]
    assert "toy_largest_y" in set(facts(results)["key"])
    no_plots = render(results, plots=False)
    assert "<img" not in no_plots and html.escape("Toy: y against x") in no_plots


def test_a_study_without_ok_runs_shows_no_figure_and_no_fact(monkeypatch):
    monkeypatch.setitem(STUDIES, "toy", TOY)
    failed = pd.DataFrame({"x": [1], "y": [None], "status": ["error"]})
    assert sections({"toy": failed}) == []
    assert list(facts({"toy": failed})["key"]) == ["runs"]


def test_the_page_order_is_each_studys_rank_then_the_registry_order(monkeypatch):
    monkeypatch.setitem(STUDIES, "toy", TOY)
    order = [s.name for s in ordered_studies()]
    assert order[0] == "toy"  # rank 0 comes first though it registered last
    ranks = [s.rank for s in ordered_studies()]
    assert ranks == sorted(ranks)
    same = {"b": Study(**{**TOY.__dict__, "name": "b"}), "a": Study(**{**TOY.__dict__, "name": "a"})}
    assert [s.name for s in ordered_studies(same)] == ["b", "a"]  # a tie keeps the registry's order


def test_every_built_in_study_declares_a_figure_with_a_unique_key():
    for name, study in STUDIES.items():
        assert study.figures, f"{name} declares no figure"
    keys = [f.key for s in STUDIES.values() for f in s.figures]
    assert len(keys) == len(set(keys))


def _report_sources() -> dict[str, str]:
    root = Path(kvfast.report.__file__).parent
    return {p.name: p.read_text() for p in sorted(root.glob("*.py"))}


def test_the_report_names_no_study_and_imports_nothing_from_one():
    study_modules = {f"kvfast.studies.{n}" for n in STUDIES}
    for name, source in _report_sources().items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert node.module not in study_modules, f"{name} imports {node.module}"
                if node.module == "kvfast.studies":
                    assert not {a.name for a in node.names} & set(STUDIES), f"{name} imports a study module"
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert node.value not in STUDIES, f"{name} names the study {node.value!r}"


def test_the_check_figures_table_counts_verdicts_per_bug_mode_and_preset():
    from kvfast.studies import check

    rows = [
        ("posfrozen", "exact", "f64", "divergent", False, 2, 5.6, None),
        ("none", "control", "f64", "rounding", True, -1, 0.0, 0.0),
        ("none", "exact", "f64", "exact", True, -1, 0.0, None),
        ("posfrozen", "exact", "f64", "divergent", False, 3, 5.0, None),
    ]
    cols = ["bug", "mode", "preset", "verdict", "passed", "first_divergent_step", "worst_deviation", "ratio"]
    df = pd.DataFrame(rows, columns=cols).assign(status="ok")
    table = check.verdict_table(df)
    assert list(table["bug"]) == ["none", "none", "posfrozen"]  # clean first, then catalogue order
    assert list(table["mode"]) == ["exact", "control", "exact"]
    assert list(table["verdicts"]) == ["exact 1", "rounding 1", "divergent 2"]
    assert list(table["passed"]) == [1, 1, 0] and list(table["first_divergent_step"]) == ["-", "-", "2-3"]
    assert table["worst_deviation"].iloc[2] == 5.6
