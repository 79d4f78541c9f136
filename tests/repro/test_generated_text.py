"""What kvfast writes for a person to run, read or click carries the user's text as data, never as code: the
command line, a model's class and type in ``reproduce.py`` (Python literals, never a docstring paste), in
``ISSUE.md`` (code spans and blocks its content cannot close, escaped text), a listing's reproducer path in
``report.html`` (a relative file link or plain text, never a scheme) and its cells on a terminal (escape
sequences shown, not run). Each guard has a control: the same attack, written the naive way, does act."""

from __future__ import annotations

import ast
import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st
from shared import ROOT

from kvfast.repro.case import ReproCase
from kvfast.repro.script import issue_text, md_block, md_code, md_text, py_text, render, write_reproducer

#: A legal folder name that closes a docstring and runs code (``--repro`` or a ``--factory-arg`` value).
INJECTION = 'ri/x""";__import__("os").system("touch PWNED");"""'
#: Text that a naive docstring paste turns into a SyntaxError (a truncated ``\x`` escape).
BAD_ESCAPE = "--factory-arg path=C:\\xyz"
#: A backtick that opens live Markdown in a naive code span, with a link and raw HTML behind it.
BACKTICK = "kvfast check m:f --factory-arg note=` [click](https://example.invalid/x) <img src=x onerror=alert(1)> *x*"
#: A terminal escape sequence (red text, then the window title set).
ESCAPE = "\x1b[31mred\x1b]0;pwned\x07"
ATTACKS = (INJECTION, BAD_ESCAPE, BACKTICK, ESCAPE, 'model"""class', "a\nb\r\u2028\udcff", "````")


def _case(command: str = "kvfast check m:f", model_class: str = "LlamaForCausalLM", model_type: str = "llama"):
    return ReproCase(
        model_class=model_class, config={"model_type": model_type, "hidden_size": 8, "note": model_type},
        seed=0, dtype="float32", attention="eager", scenario="decode", prompt=(1, 2), tokens=(3,),
        calls={"cache_arg": "past_key_values", "own_cache": False, "mask": {}}, verdict="bug", first_bug_step=1,
        deviation=(0.0, 1.0), threshold=(0.0, 0.5), threshold_origin="exact", versions={"transformers": model_type},
        command=command,
    )  # fmt: skip


def _constants(script: str) -> dict:
    """The script's module-level ``NAME = literal`` assignments (``CONFIG`` through its ``json.loads``)."""
    out = {}
    for node in ast.parse(script).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            value = node.value
            if isinstance(value, ast.Call) and ast.unparse(value.func) == "json.loads":
                out[node.targets[0].id] = json.loads(ast.literal_eval(value.args[0]))
            else:
                out[node.targets[0].id] = ast.literal_eval(value)
    return out


@pytest.mark.parametrize("attack", ATTACKS)
def test_the_script_holds_the_command_the_class_and_the_type_as_data(attack):
    """Each attack as the command line, the model's class and its model type: the script compiles, its docstring
    holds the text exactly, its constants are the case's values, and it has no statement the template lacks."""
    plain = ast.parse(render(_case()))
    script = render(_case(attack, attack, attack))
    tree = ast.parse(script)  # a SyntaxError here is the bug
    compile(script, "reproduce.py", "exec")
    doc = ast.get_docstring(tree, clean=False)
    assert f"Found by: {attack}\n" in doc and doc.startswith(f"{attack} (")
    assert [type(n) for n in tree.body] == [type(n) for n in plain.body]  # nothing added: the same statements
    constants = _constants(script)
    assert constants["MODEL_CLASS"] == attack and constants["CONFIG"]["model_type"] == attack
    assert constants["FOUND_ON"] == attack and attack in constants["FOUND_VERSIONS"]


@given(st.text())
def test_py_text_is_a_literal_of_exactly_its_text(text):
    literal = py_text(text)
    assert ast.literal_eval(literal) == text and len(ast.parse(literal).body) == 1


@pytest.mark.subprocess
def test_control_a_docstring_paste_runs_the_injection_and_breaks_on_an_escape(tmp_path):
    """The attacks are live: pasted into a docstring as the script used to, one runs a command, one is a
    SyntaxError; the same text through :func:`py_text` runs nothing and compiles."""
    pasted, encoded = f'"""Found by: {INJECTION}\n"""', py_text(f"Found by: {INJECTION}\n")
    for how, literal in (("pasted", pasted), ("encoded", encoded)):
        (tmp_path / f"{how}.py").write_text(f"{literal}\n")
        subprocess.run([sys.executable, "-I", f"{how}.py"], cwd=tmp_path, capture_output=True, timeout=60)
        assert (tmp_path / "PWNED").exists() == (how == "pasted"), how
        (tmp_path / "PWNED").unlink(missing_ok=True)
    with pytest.raises(SyntaxError):
        compile(f'"""Found by: {BAD_ESCAPE}\n"""', "pasted.py", "exec")
    compile(py_text(f"Found by: {BAD_ESCAPE}\n"), "encoded.py", "exec")


@pytest.mark.subprocess
def test_a_real_reproducer_found_by_an_injecting_command_runs_only_its_check(tmp_path):
    """A real finding (a tiny Llama with kvfast's posoff bug) whose command line holds the injection and a bad
    escape: its script, run as a maintainer runs it, shows the bug (exit 1), creates nothing and names the
    command exactly."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import numpy as np

    from kvfast.bugs.hf import inject_hf_bug
    from kvfast.check.hf import HFModel
    from kvfast.repro import find_case
    from kvfast.testing import tiny_model

    adapter = inject_hf_bug(HFModel(tiny_model("llama")), "posoff")
    command = f"kvfast check buggy:model --repro {INJECTION} {BAD_ESCAPE} {BACKTICK}"
    case = find_case(adapter, np.array([5, 17, 42, 8]), "decode", continuation=np.array([3, 61]), command=command)
    script = write_reproducer(case, tmp_path / "repro")
    done = subprocess.run(
        [sys.executable, "-I", script.name], cwd=script.parent, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 1 and "first differing step: 1" in done.stdout, done.stdout + done.stderr
    assert not list(tmp_path.rglob("PWNED")) and not (script.parent / "PWNED").exists()
    assert f"Found by: {command}\n" in ast.get_docstring(ast.parse(script.read_text()), clean=False)


def _markdown():
    markdown_it = pytest.importorskip("markdown_it", reason="markdown-it-py (CommonMark) renders the Markdown")
    return markdown_it.MarkdownIt("commonmark").enable("table")


def _code_and_text(tokens) -> tuple[list[str], list[str], set[str]]:
    """The code spans' and blocks' contents, the plain text, and every other inline token type of a rendering."""
    code, text, other = [], [], set()
    for token in tokens:
        if token.type in ("fence", "code_block"):
            code.append(token.content)
        for child in token.children or ():
            if child.type == "code_inline":
                code.append(child.content)
            elif child.type == "text":
                text.append(child.content)
            elif child.type not in ("softbreak", "strong_open", "strong_close"):
                other.add(child.type)
    return code, text, other


@pytest.mark.parametrize("attack", ATTACKS)
def test_issue_md_shows_the_command_and_names_as_code_or_text(attack):
    """ISSUE.md through a CommonMark parser: the command is one code span holding it (its characters that are
    not printable as escapes), the class and type are code or text, and nothing else of theirs is Markdown: no
    link, image, HTML or emphasis appears."""
    from kvfast.validation import printable

    md = _markdown()
    issue = issue_text(_case(attack, attack, attack))
    code, text, other = _code_and_text(md.parse(issue))
    assert printable(attack) in code  # the command (and the model's class and type) as one code span each
    assert not other & {"link_open", "image", "html_inline", "em_open"}, other
    assert not [t for t in md.parse(issue) if t.type == "html_block"]
    assert any(printable(attack) in t for t in text)  # the title: the text shown as it is
    assert json.loads([c for c in code if c.startswith("{")][0])["model_type"] == attack


def test_control_a_naive_code_span_lets_a_backtick_open_live_markdown():
    md = _markdown()
    naive = f"- how it was found: `{BACKTICK}`"
    _, _, other = _code_and_text(md.parse(naive))
    assert {"link_open", "html_inline", "em_open"} <= other  # the attack is live written the naive way
    code, _, other = _code_and_text(md.parse(f"- how it was found: {md_code(BACKTICK)}"))
    assert code == [BACKTICK] and not other
    _, text, other = _code_and_text(md.parse(md_text(BACKTICK)))
    assert "".join(text) == BACKTICK and not other
    fence = "```" + "`" * 5
    block = "\n".join(md_block(f"x\n{fence}\n<script>alert(1)</script>"))
    assert [t.content for t in md.parse(block) if t.type == "fence"] == [f"x\n{fence}\n<script>alert(1)</script>\n"]


# --- report.html and the terminal ---------------------------------------------------------------------------

LINK_ATTACKS = ("javascript:void(top.document.title='PWNED')", "data:text/html,<script>alert(1)</script>",
                "https://example.invalid/reproduce.py", "javascript:alert(1)//reproduce.py")  # fmt: skip


def _listing(tmp_path: Path, reproducers: list[str]) -> Path:
    """A scan's results folder whose ``findings.csv`` (beside it, as ``kvfast scan --repro`` writes it) lists
    ``reproducers`` as tampered cells; the results folder's path."""
    from kvfast.repro.findings import COLUMNS, FINDINGS_CSV
    from kvfast.sweep.store import MANIFEST

    results = tmp_path / "scan"
    results.mkdir()
    (results / MANIFEST).write_text(json.dumps({"study": "hf_scan"}))
    (tmp_path / "scan.repro").mkdir()
    rows = [dict.fromkeys(COLUMNS, "") | {"label": "new", "architecture": ESCAPE, "reproducer": r, "step": 1}
            for r in reproducers]  # fmt: skip
    pd.DataFrame(rows, columns=list(COLUMNS)).to_csv(tmp_path / "scan.repro" / FINDINGS_CSV, index=False)
    return results


def _hrefs(page: str) -> list[str]:
    from html.parser import HTMLParser

    found = []

    class Links(HTMLParser):
        def handle_starttag(self, tag, attrs):
            if tag == "a":
                found.append(dict(attrs).get("href"))

    Links().feed(page)
    return found


def test_the_report_links_only_relative_files_and_shows_any_other_path_as_text(tmp_path, monkeypatch):
    """A tampered listing's reproducer cells (read from the report's folder, where a relative cell lands beside
    the page): a ``javascript:`` or ``data:`` URL, a web address, a scheme in front of ``reproduce.py``; each is
    text or a relative file link that holds no scheme; the real reproducer's link is kept (the control: a link
    is made where one is due)."""
    from urllib.parse import urlsplit

    from kvfast.report.scan_findings import findings_html, scan_findings

    real = str(tmp_path / "scan.repro" / "llama-float32-decode-none" / "reproduce.py")
    results = _listing(tmp_path, [*LINK_ATTACKS, real])
    (tmp_path / "scan.report").mkdir()
    monkeypatch.chdir(tmp_path / "scan.report")
    page = findings_html(scan_findings(results), Path("."))
    hrefs = _hrefs(page)
    assert "../scan.repro/llama-float32-decode-none/reproduce.py" in hrefs
    for href in hrefs:
        assert not urlsplit(href).scheme and not href.startswith("/") and not urlsplit(href).netloc, href
    assert "javascript:void(top.document.title=&#x27;PWNED&#x27;)" in page  # shown, as text


def test_control_the_link_of_a_javascript_path_written_the_old_way_has_a_scheme(tmp_path):
    from urllib.parse import urlsplit

    old = html.escape(os.path.relpath(Path(LINK_ATTACKS[0]).absolute(), Path.cwd()))  # the page beside the cwd
    assert urlsplit(old).scheme == "javascript"


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("headless Chromium is not installed (apt-get install chromium); the link check above covers it")
    return found


def _click_first_link(chromium: str, page: Path, tmp_path: Path) -> str:
    """Open ``page`` in headless Chromium (in a frame), click the first link of its findings table (as a person
    does) and return the title of the top document afterwards: ``clicked``, or ``PWNED`` where the link ran a
    script."""
    wrapper = tmp_path / "click.html"
    wrapper.write_text(
        f'<html><head><title>waiting</title></head><body><iframe id="f" src="{page.as_uri()}"></iframe><script>'
        "const f = document.getElementById('f');"
        "f.onload = () => { if (document.title !== 'waiting') return; document.title = 'clicked';"
        "  f.contentDocument.querySelector('#findings ~ table a').click(); };"
        "</script></body></html>"
    )
    done = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files",
         "--virtual-time-budget=5000", "--dump-dom", wrapper.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return done.stdout[done.stdout.index("<title>") + 7 : done.stdout.index("</title>")]


def test_a_browser_click_on_a_tampered_reproducer_link_runs_nothing(tmp_path, monkeypatch):
    """The page as a person meets it: headless Chromium clicks the findings table's first link, whose cell is a
    ``javascript:`` URL before ``/reproduce.py`` (read from the page's folder: the relative path lands beside the
    page). kvfast's link is a relative file path: the click runs nothing. The control: the same page with that
    link's href written as the page wrote it before (the path, its tags escaped) runs the script."""
    from kvfast.report.scan_findings import findings_html, scan_findings

    chromium = _chromium()
    results = _listing(tmp_path, [f"{LINK_ATTACKS[0]}//reproduce.py", LINK_ATTACKS[0]])
    page_dir = tmp_path / "scan.report"
    page_dir.mkdir()
    monkeypatch.chdir(page_dir)
    body = findings_html(scan_findings(results), Path("."))
    page = page_dir / "report.html"
    page.write_text(f"<html><head><title>report</title></head><body>{body}</body></html>")
    assert _click_first_link(chromium, page, tmp_path) == "clicked"
    control = page_dir / "old.html"
    old_href = html.escape(f"{LINK_ATTACKS[0]}/reproduce.py")
    control.write_text(re.sub('<a href="[^"]*"', f'<a href="{old_href}"', page.read_text(), count=1))
    assert _click_first_link(chromium, control, tmp_path) == "PWNED"


@pytest.mark.subprocess
def test_listing_cells_reach_the_terminal_as_text(tmp_path):
    """A tampered listing on the terminal: ``kvfast report --markdown findings`` (a real process) and the plain
    listing show its escape sequence as ``\\x1b``, never send it; the control is the raw cell, which holds the
    escape character itself."""
    from kvfast.report.scan_findings import findings_text, scan_findings

    results = _listing(tmp_path, [f"{tmp_path}/x{ESCAPE}/reproduce.py"])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "kvfast.cli", "report", str(results), "--markdown", "findings"],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    for shown in (done.stdout, findings_text(scan_findings(results))):
        assert "\x1b" not in shown and "\\x1b[31mred" in shown and "\\x1b]0;pwned\\x07" in shown, shown
    assert ESCAPE in scan_findings(results)["architecture"][0]  # the control: the cell holds it
