"""Hostile inputs from issue 23: each gives the right verdict, or one line with the documented exit code,
no traceback, and nothing lost."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvfast.cli import main
from kvfast.validation import LINE_CHARS, SHOWN_CHARS, import_extra, not_allowed, one_line, shorten, shown

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


@pytest.mark.parametrize(
    ("importer", "module", "extra"),
    [
        ("kvfast.check.engines.llamacpp:_llama_cpp", "llama_cpp", "llamacpp"),
        ("kvfast.check.engines.ort:_modules", "onnxruntime_genai", "ort"),
        ("kvfast.check.hf:_torch", "torch", "hf"),
    ],
)
def test_a_missing_optional_extra_is_a_value_error_naming_module_and_extra(monkeypatch, importer, module, extra):
    import importlib

    path, name = importer.split(":")
    load = getattr(importlib.import_module(path), name)
    monkeypatch.setitem(sys.modules, module, None)  # import_module raises ImportError for a None entry
    with pytest.raises(ValueError, match=rf"^model: .* needs {module}; allowed: pip install 'kvfast\[{extra}\]'$"):
        load()


def test_the_dask_backend_without_distributed_names_the_dask_extra(monkeypatch):
    from kvfast.sweep.backends.dask import dask_client

    monkeypatch.setitem(sys.modules, "distributed", None)
    message = r"^--backend: 'dask' needs distributed; allowed: pip install 'kvfast\[dask\]'$"
    with pytest.raises(ValueError, match=message):
        dask_client(1, None)


def test_import_extra_returns_an_installed_module():
    assert import_extra("json", "a test", "none") is sys.modules["json"]


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


# --- finding 4: a damaged or unwritable Numba cache is named, never blamed on the model ------------------

BF16_ONCE = "import numpy as np, kvfast; print(kvfast.to_bfloat16(np.array([1.0 + 2.0**-8 + 2.0**-30]))[0])"


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


def test_a_damaged_numba_cache_is_compiled_again_and_named_in_one_line(tmp_path):
    cache = tmp_path / "numba"
    first = _python(BF16_ONCE, {"NUMBA_CACHE_DIR": str(cache)})
    assert first.returncode == 0 and first.stdout == "1.0078125\n" and first.stderr == "", first.stderr
    damaged = sorted(cache.rglob("*.nbi")) + sorted(cache.rglob("*.nbc"))
    assert damaged
    for path in damaged:  # a pickle header announcing a frame that is not there, then noise
        path.write_bytes(b"\x80\x04\x95\xff\xff" + bytes(range(7, 107)))
    second = _python(BF16_ONCE, {"NUMBA_CACHE_DIR": str(cache)})
    assert second.returncode == 0 and second.stdout == "1.0078125\n", second.stderr
    lines = second.stderr.splitlines()
    assert lines and all(line.startswith("kvfast: the Numba cache file ") and "is damaged" in line for line in lines)
    assert all(f"delete {cache}" in line for line in lines) and "Traceback" not in second.stderr
    third = _python(BF16_ONCE, {"NUMBA_CACHE_DIR": str(cache)})  # repaired: silent again
    assert third.returncode == 0 and third.stdout == "1.0078125\n" and third.stderr == "", third.stderr


def test_an_unwritable_numba_cache_dir_falls_back_to_a_private_one_and_says_so(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    wanted = blocker / "numba"  # cannot be created, even by root
    run = _python(BF16_ONCE, {"NUMBA_CACHE_DIR": str(wanted), "TMPDIR": str(tmp_path)})
    assert run.returncode == 0 and run.stdout == "1.0078125\n"
    (line,) = run.stderr.splitlines()
    assert line.startswith(f"kvfast: the Numba cache directory {wanted} cannot be written; caching kernels in ")
    assert list((tmp_path / f"kvfast-numba-{os.getuid()}").rglob("*.nbi"))  # the fallback holds the kernels


# --- finding 8: nesting too deep; planning: duplicate axis values -------------------------------------


def test_a_grid_nested_600_deep_is_one_line_and_exit_2(tmp_path, capsys):
    toml = tmp_path / "deep.toml"
    toml.write_text('study = "bugs"\n[axes]\nbug = ' + "[" * 600 + "1" + "]" * 600 + "\n")
    code = main(["run", str(toml), "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "nested too deep to parse; allowed: at most 64 levels" in err


def test_a_spec_nested_too_deep_is_a_value_error_naming_where():
    from kvfast.sweep.grid import grid_from_spec

    value = 1
    for _ in range(600):
        value = [value]
    with pytest.raises(ValueError, match=r"axes\.bug(\[0\])+: nested more than 64 deep is not allowed"):
        grid_from_spec({"study": "bugs", "axes": {"bug": [value]}})


def test_duplicate_axis_values_are_dropped_before_planning_keeping_types_and_signs_apart():
    from kvfast.sweep.grid import _distinct

    assert _distinct([1, 1.0, True, 0.0, -0.0, 1, "1", 1.0, -0.0]) == [1, 1.0, True, 0.0, -0.0, "1"]
    kept = _distinct([0.0, -0.0])
    assert [str(v) for v in kept] == ["0.0", "-0.0"]
    many = [3] * 100_000 + [1] * 100_000
    assert _distinct(many) == [3, 1]


def test_a_grid_of_many_duplicates_is_the_grid_of_its_distinct_values():
    from kvfast.sweep.grid import grid_from_spec

    axes = {"seed": [0, 1], "n": [10], "scale": [1], "order": ["sorted"]}
    small = grid_from_spec({"study": "examples.sum_order_study:STUDY", "axes": axes})
    big = grid_from_spec({"study": "examples.sum_order_study:STUDY", "axes": dict(axes, seed=[0, 1] * 50_000)})
    assert len(big) == len(small) == 2 and list(big.iter_ids()) == list(small.iter_ids())


# --- kvfast.load on a directory holding a foreign Parquet file named like a part ----------------------


@pytest.mark.parametrize("columns", [{"a": [1, 2]}, {"run_id": ["x"], "b": [1]}])
def test_a_foreign_part_is_named_in_one_line(tmp_path, monkeypatch, columns, capsys):
    import pandas as pd

    import kvfast

    monkeypatch.chdir(ROOT)  # the user study is examples.sum_order_study
    toml = tmp_path / "small.toml"
    toml.write_text('study = "examples.sum_order_study:STUDY"\n[axes]\nseed = [0, 1]\nn = [10]\nscale = [1]\n'
                    'order = ["sorted"]\n')  # fmt: skip
    out = tmp_path / "res"
    assert main(["run", str(toml), "--out", str(out), "--quiet", "--jobs", "1"]) == 0
    before = kvfast.load(out)
    foreign = out / "part-99999999-deadbeef.parquet"
    pd.DataFrame(columns).to_parquet(foreign)
    with pytest.raises(ValueError, match=r"part-99999999-deadbeef\.parquet: not a part of these results"):
        kvfast.load(out)
    capsys.readouterr()
    assert main(["show", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"move it out of {out}" in err
    foreign.unlink()
    assert kvfast.load(out).equals(before)  # nothing stored was touched
