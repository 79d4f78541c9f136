"""The command line explains itself: every subcommand has a description and every positional argument a help
line; ``kvfast grids`` says which extra a grid needs where that extra is missing, and ``invalid`` only for a
grid that is wrong."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from kvfast.cli import build_parser, main
from kvfast.validation import MissingExtra


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_subcommand_has_a_description_and_every_positional_a_help_line():
    commands = subcommands()
    assert {"check", "run", "show", "grids", "repair", "study", "reproduce", "report", "scan", "bench"} <= set(commands)
    for name, parser in commands.items():
        assert parser.description and len(parser.description) > 40, name
        for action in parser._actions:
            if not action.option_strings:
                assert action.help and action.help != argparse.SUPPRESS, f"{name} {action.dest}"


def test_a_subcommand_without_a_description_is_found():
    """The control: the same walk over a parser with a bare subcommand finds it."""
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    sub.add_parser("bare").add_argument("dir")
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    bare = action.choices["bare"]
    assert not bare.description
    assert [a.dest for a in bare._actions if not a.option_strings and not a.help] == ["dir"]


def test_help_of_every_subcommand_prints(capsys):
    for name in subcommands():
        with pytest.raises(SystemExit) as exit_:
            main([name, "--help"])
        assert exit_.value.code == 0
        assert "usage: kvfast " + name in capsys.readouterr().out


def without(monkeypatch, *modules: str, present: tuple[str, ...] = ()) -> None:
    """``importlib.util.find_spec`` finds none of ``modules``, as where their extra is not installed (and finds
    each of ``present``, installed or not)."""
    real = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name in modules else object() if name in present else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def grids_rows(capsys) -> dict[str, str]:
    assert main(["grids"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    return {line.split()[0]: line for line in lines}


def test_grids_say_which_extra_a_grid_needs(monkeypatch, capsys):
    without(monkeypatch, "torch", "llama_cpp")
    rows = grids_rows(capsys)
    for name in ("hf_matrix", "hf_score", "hf_scan"):
        assert f"{name} needs kvfast[hf]" in " ".join(rows[name].split()), rows[name]
    assert "engines needs kvfast[" in " ".join(rows["engines_all"].split())  # the first extra its runs meet
    assert "exactness 1296" in " ".join(rows["exactness"].split())
    assert not any("invalid" in row for row in rows.values())


def test_a_wrong_grid_is_still_invalid(monkeypatch, capsys, tmp_path):
    """The control: a grid that is wrong (not one missing an extra) is ``invalid``, with its reason."""
    import kvfast.sweep.grid as grid

    bad = tmp_path / "bad.toml"
    bad.write_text('study = "exactness"\n[axes]\ncolour = ["red"]\n')
    real = grid.builtin_grids
    monkeypatch.setattr(grid, "builtin_grids", lambda: {**real(), "bad": bad})
    row = grids_rows(capsys)["bad"]
    assert "invalid" in row and "colour" in row


@pytest.mark.parametrize(
    "engine, cache, missing, extras",
    [
        ("llamacpp", "f16", ("llama_cpp",), "llamacpp"),
        ("llamacpp", "f16", ("llama_cpp", "torch"), "llamacpp,hf"),
        ("transformers", "native", ("torch",), "hf"),
    ],
)
def test_the_engines_study_names_the_extras_to_install(monkeypatch, engine, cache, missing, extras):
    from kvfast.studies import STUDIES

    without(monkeypatch, *missing, present=("torch", "transformers", "llama_cpp"))
    config = {"engine": engine, "weights": "f32", "cache": cache, "seed": 0, "prompt": 0, "steps": 4, "bug": "none"}
    with pytest.raises(MissingExtra, match=rf"pip install 'kvfast\[{extras}\]'") as refused:
        STUDIES["engines"].validate_config(config)
    assert refused.value.extra == extras
