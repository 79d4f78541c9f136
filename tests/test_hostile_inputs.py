"""Hostile inputs from issue 23: each gives the right verdict, or one line with the documented exit code,
no traceback, and nothing lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfast.cli import main
from kvfast.validation import LINE_CHARS, SHOWN_CHARS, not_allowed, one_line, shorten, shown

ROOT = Path(__file__).resolve().parents[1]


# --- finding 9: a huge value is quoted shortened ------------------------------------------------------


def test_shorten_keeps_short_text_and_cuts_long_text_to_its_limit():
    assert shorten("abc", 10) == "abc"
    long = "a" * 500 + "b" * 500
    out = shorten(long, 200)
    assert len(out) <= 200 and out.startswith("aaa") and out.endswith("b (1,000 characters)")
    assert "..." in out


def test_not_allowed_quotes_a_huge_value_shortened_with_its_length():
    exc = not_allowed("order", "x" * 5_000_000, "sequential, pairwise")
    msg = str(exc)
    assert len(msg) < SHOWN_CHARS + 100
    assert "(5,000,002 characters)" in msg and msg.endswith("allowed: sequential, pairwise")
    assert shown("ok") == "'ok'"  # a short value is quoted as it is


def test_one_line_collapses_newlines_and_bounds_the_length():
    assert one_line("a\n  b\tc") == "a b c"
    assert len(one_line("y" * 10**6)) <= LINE_CHARS


def test_a_5_mb_axis_value_is_one_short_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the user study is examples.sum_order_study
    toml = tmp_path / "big.toml"
    big = "x" * 5_000_000
    toml.write_text(f'study = "examples.sum_order_study:STUDY"\n[axes]\nseed = [0]\nn = [10]\nscale = [1]\n'
                    f'order = ["{big}"]\n')  # fmt: skip
    code = main(["run", str(toml), "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and len(err) < LINE_CHARS + 50, len(err)
    assert "(5,000,002 characters)" in err and "allowed: sequential, pairwise, sorted" in err
    assert not (tmp_path / "out").exists()  # refused before any work


def test_a_long_message_from_user_code_is_still_one_bounded_line(tmp_path, monkeypatch, capsys):
    """A user's own ValueError (not built with not_allowed), many lines and megabytes long."""
    (tmp_path / "loud_study.py").write_text(
        "from examples.sum_order_study import STUDY as S\n"
        "import dataclasses\n"
        "def validate_config(config):\n"
        "    raise ValueError('bad\\n' * 400_000)\n"
        "STUDY = dataclasses.replace(S, name='loud', validate_config=validate_config)\n"
    )
    toml = tmp_path / "loud.toml"
    toml.write_text('study = "loud_study:STUDY"\n[axes]\nseed = [0]\nn = [10]\nscale = [1]\norder = ["sorted"]\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    code = main(["run", str(toml), "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err[:500]
    assert err.count("\n") == 1 and len(err) < LINE_CHARS + 50
    assert "Traceback" not in err


@pytest.mark.parametrize("value", [["x"] * 3, {"a": "b" * 10_000}])
def test_shown_bounds_any_value(value):
    assert len(shown(value)) <= SHOWN_CHARS
