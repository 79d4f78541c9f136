"""Hostile inputs from issue 23: each gives the right verdict, or one line with the documented exit code,
no traceback, and nothing lost."""

from __future__ import annotations

import os
import pickle
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from shared import ROOT

from kvfast.cli import main
from kvfast.validation import LINE_CHARS, SHOWN_CHARS, import_extra, not_allowed, one_line, shorten, shown

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


@pytest.mark.subprocess
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


@pytest.mark.subprocess
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
    """``python -c code`` with ``env`` over this process's environment (a ``None`` value: the variable unset)."""
    env = {k: v for k, v in {**os.environ, "PYTHONPATH": str(ROOT), **env}.items() if v is not None}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.subprocess
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


@pytest.mark.subprocess
def test_an_unwritable_numba_cache_dir_is_one_line_and_no_cache(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    wanted = blocker / "numba"  # cannot be created, even by root
    run = _python(BF16_ONCE, {"NUMBA_CACHE_DIR": str(wanted), "TMPDIR": str(tmp_path)})
    assert run.returncode == 0 and run.stdout == "1.0078125\n"
    (line,) = run.stderr.splitlines()
    assert line.startswith(f"kvfast: the Numba cache directory {wanted} cannot be written (Not a directory); ")
    assert "compiled afresh in every process, not cached" in line
    assert list(tmp_path.iterdir()) == [blocker]  # no fallback directory anywhere


# --- issue 42: no cache directory kvfast did not make for this user ------------------------------------
# Numba loads its index files with pickle: whoever can write a cache directory kvfast uses runs code as the
# kvfast user. A second local user (created here; root only) plants index files whose loading writes the loading
# process's uid to a file.

OTHER_USER = "kvfast-w42-other"


class _Payload:
    def __init__(self, mark: Path):
        self.mark = mark

    def __reduce__(self):
        return os.system, (f"id -u > {self.mark}",)


@pytest.fixture
def other_user():
    """A second local user (``useradd``), and a shared directory like ``/tmp`` (mode 1777) both can reach."""
    if os.geteuid() != 0 or not (shutil.which("useradd") and shutil.which("runuser")):
        pytest.skip("needs root, useradd and runuser: a second local user plants the files")
    if subprocess.run(["id", OTHER_USER], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--no-create-home", OTHER_USER], check=True)
    shared = Path(tempfile.mkdtemp(prefix="kvfast-shared-", dir="/tmp"))
    shared.chmod(0o1777)
    yield pwd.getpwnam(OTHER_USER).pw_uid, shared
    shutil.rmtree(shared)


def _plant(shared: Path, dest: Path) -> Path:
    """``dest`` made by the other user, holding kvfast's kernel cache for :data:`BF16_ONCE` with every index file
    replaced by a :class:`_Payload`; the file the payload writes."""
    scratch = shared / "scratch"
    first = _python(BF16_ONCE, {"NUMBA_CACHE_DIR": str(scratch)})  # the file names Numba looks for
    assert first.returncode == 0 and first.stderr == "", first.stderr
    mark = shared / "ran-as-uid"
    for index in scratch.rglob("*.nbi"):
        index.write_bytes(pickle.dumps(_Payload(mark)))
    subprocess.run(["chmod", "-R", "a+rX", str(scratch)], check=True)
    script = 'mkdir -p "$1" && cp -r "$2"/. "$1"/'
    subprocess.run(["runuser", "-u", OTHER_USER, "--", "sh", "-c", script, "sh", str(dest), str(scratch)], check=True)
    shutil.rmtree(scratch)
    return mark


@pytest.mark.subprocess
@pytest.mark.parametrize("inherited", [False, True], ids=["found", "inherited"])
def test_kvfasts_cache_directory_made_by_another_user_is_never_loaded(other_user, inherited):
    """``XDG_CACHE_HOME`` in a shared directory: the other user made ``kvfast/numba/KEY`` there first, planted.
    kvfast refuses it (one line naming the owner) and compiles afresh: the payload never runs; so does a child
    process that inherits the path as ``NUMBA_CACHE_DIR`` (``inherited``). Control: the same tree made this
    user's, mode 0700, is used: the payload runs, as this user."""
    from kvfast.kernels import source_key

    uid, shared = other_user
    key_dir = shared / "kvfast" / "numba" / source_key()
    mark = _plant(shared, key_dir)
    run = _python(BF16_ONCE, {"XDG_CACHE_HOME": str(shared), "NUMBA_CACHE_DIR": str(key_dir) if inherited else None})
    assert run.returncode == 0 and run.stdout == "1.0078125\n", run.stderr
    (line,) = run.stderr.splitlines()
    assert line.startswith(f"kvfast: not caching kernels in {shared / 'kvfast'}: it is owned by uid {uid}, not this")
    assert not mark.exists()
    subprocess.run(["chown", "-R", f"{os.getuid()}:{os.getgid()}", str(shared / "kvfast")], check=True)
    for level in (key_dir.parent.parent, key_dir.parent, key_dir):
        level.chmod(0o700)
    control = _python(BF16_ONCE, {"XDG_CACHE_HOME": str(shared), "NUMBA_CACHE_DIR": None})
    assert control.returncode == 0 and control.stderr == "", control.stderr
    assert mark.read_text().split() == [str(os.getuid())]


@pytest.mark.subprocess
@pytest.mark.parametrize("mode", [0o770, 0o707], ids=["group", "others"])
def test_kvfasts_cache_directory_others_can_write_is_refused(other_user, mode):
    """This user's own ``kvfast/numba/KEY``, but its group or others can write it (where another user could have
    planted files): refused, one line naming the mode, the payload never runs."""
    from kvfast.kernels import source_key

    _, shared = other_user
    key_dir = shared / "kvfast" / "numba" / source_key()
    mark = _plant(shared, key_dir)
    subprocess.run(["chown", "-R", f"{os.getuid()}:{os.getgid()}", str(shared / "kvfast")], check=True)
    key_dir.chmod(mode)
    run = _python(BF16_ONCE, {"XDG_CACHE_HOME": str(shared), "NUMBA_CACHE_DIR": None})
    assert run.returncode == 0 and run.stdout == "1.0078125\n", run.stderr
    (line,) = run.stderr.splitlines()
    assert line.startswith(
        f"kvfast: not caching kernels in {key_dir}: its group or others can write it (mode {mode:o})"
    )
    assert not mark.exists()


@pytest.mark.subprocess
def test_an_unwritable_numba_cache_dir_never_falls_back_to_a_folder_another_user_made(other_user, tmp_path):
    """The attack on the old fallback: with ``NUMBA_CACHE_DIR`` unwritable, kvfast cached in
    ``$TMPDIR/kvfast-numba-UID/NAME`` whoever made it. The other user makes it first, planted: kvfast no longer
    looks there (no cache, one line). Control: the planted folder, once used as a cache, runs the payload."""
    _, shared = other_user
    planted = shared / f"kvfast-numba-{os.getuid()}" / "numba"
    mark = _plant(shared, planted)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    run = _python(BF16_ONCE, {"NUMBA_CACHE_DIR": str(blocker / "numba"), "TMPDIR": str(shared)})
    assert run.returncode == 0 and run.stdout == "1.0078125\n", run.stderr
    assert len(run.stderr.splitlines()) == 1 and "cannot be written" in run.stderr
    assert not mark.exists()
    control = _python(BF16_ONCE, {"NUMBA_CACHE_DIR": str(planted)})  # the user's own choice: used as it is
    assert control.returncode == 0 and control.stdout == "1.0078125\n", control.stderr
    assert mark.read_text().split() == [str(os.getuid())]


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
