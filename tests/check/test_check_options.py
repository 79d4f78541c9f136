"""``CheckOptions``: the checker's options as one object, validated once, shared by ``check_cache``, the
``kv_check`` fixture, ``kvfast check`` and the check study; the command line's flags built from its fields;
the model's declarations (``lossy_cache``, ``internal_formats``) validated, and read as the model's code;
every ``kv_check`` failure one line; and the checker's code layout."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import subprocess
import sys
from collections.abc import Mapping

import numpy as np  # loaded before pytester's in-process runs, which drop modules first loaded inside them
import pytest
from shared import ROOT
from toymodels import Toy

from kvfast import ModelConfig, init_params
from kvfast.check import CheckOptions, KvfastModel, ModelUnderTestError, check_cache, check_cache_with
from kvfast.check.lossy import DECLARED_FORMATS, LossyKvfastModel, round_trip
from kvfast.check.options import DEFAULT_STEPS, PROMOTE, flags
from kvfast.cli import build_parser, main

pytest_plugins = ["pytester"]

CFG = ModelConfig(vocab=32, d_model=16, n_head=2, n_layer=2, d_ff=32, max_pos=48)
PROMPT = [3, 1, 4, 1, 5, 9]


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 0)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(steps=None), "steps: None is not allowed; allowed: an integer >= 1 (or give a continuation)"),
        (dict(steps=0), "steps: 0 is not allowed"),
        (dict(steps=3, continuation=[1, 2]), "steps: 3 is not allowed"),
        (dict(continuation=[]), "continuation: shape (0,) is not allowed"),
        (dict(continuation=[1, -1]), "continuation: token -1 is out of range"),
        (dict(mode="loose"), "mode: 'loose' is not allowed"),
        (dict(scenarios=()), "scenarios: () is not allowed"),
        (dict(scenarios="warp"), "scenarios: 'warp' is not allowed"),
        (dict(scenarios=("decode", "decode")), "scenarios: 'decode' appears twice; allowed: each scenario once"),
        (dict(fast=1), "fast: 1 is not allowed; allowed: True or False"),
        (dict(keep_logits="yes"), "keep_logits: 'yes' is not allowed; allowed: True or False"),
        (dict(follow="mine"), "follow: 'mine' is not allowed; allowed: recompute, cache"),
        (dict(follow="cache", mode="control"), "follow: 'cache' is not allowed with mode='control'"),
        (dict(follow="cache", steps=2, continuation=[1, 2]), "follow: 'cache' is not allowed with a continuation"),
        (dict(promote="float16"), "promote: 'float16' is not allowed"),
        (dict(margin=0.5), "margin: 0.5 is not allowed; allowed: a finite number >= 1"),
        (dict(decisive=2.0), "decisive: 2.0 is not allowed; allowed: a finite number >= 4"),
        (dict(timeout=-1), "timeout: -1 is not allowed; allowed: None or a number of seconds > 0"),
    ],
)
def test_each_bad_field_is_a_value_error_naming_it(fields, message):
    fields = {"steps": 4, **fields}
    with pytest.raises(ValueError) as exc:
        CheckOptions(**fields)
    assert message in str(exc.value)


def test_options_are_normalized_and_frozen():
    options = CheckOptions(continuation=np.array([5, 6, 7]), scenarios="resume", margin=2, decisive=8)
    assert options.steps == 3 and options.continuation == (5, 6, 7) and options.scenarios == ("resume",)
    assert isinstance(options.margin, float) and isinstance(options.decisive, float)
    assert CheckOptions(2, continuation=[5, 6, 7]).continuation == (5, 6)
    assert options.given_tokens().dtype == np.int64
    assert hash(options) == hash(dataclasses.replace(options))
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.mode = "control"  # type: ignore[misc]
    assert CheckOptions.defaulting_steps().steps == DEFAULT_STEPS == 64
    assert CheckOptions.defaulting_steps(continuation=[1, 2]).steps == 2


def test_check_cache_with_options_is_check_cache(params):
    model = KvfastModel(CFG, params, "f32", bug="posfrozen")
    fields = dict(steps=8, mode="control", scenarios=("resume", "decode"), split=2, keep_logits=True)
    a = check_cache(model, PROMPT, **fields)
    b = check_cache_with(model, PROMPT, CheckOptions(**fields))
    assert a.format() == b.format() and a.verdict == b.verdict == "bug"
    for name in a.scenarios:
        assert np.array_equal(a.scenarios[name].bounds.ratio, b.scenarios[name].bounds.ratio)
        assert np.array_equal(a.scenarios[name].cache_logits, b.scenarios[name].cache_logits)
    with pytest.raises(ValueError, match="options: dict is not allowed; allowed: a CheckOptions"):
        check_cache_with(model, PROMPT, fields)  # type: ignore[arg-type]


def test_the_check_study_builds_its_options_from_the_config():
    from kvfast.studies.check import check_options

    options = check_options({"steps": 6, "mode": "control", "scenarios": "both", "promote": "none"})
    assert options == CheckOptions(6, "control", ("decode", "resume"))
    logic = check_options({"steps": 6, "mode": "auto", "scenarios": "decode", "promote": "float64"})
    assert logic == CheckOptions(6, "auto", ("decode",), promote="float64")


# --- layout -----------------------------------------------------------------------------------

CHECKER = (
    "checker.py", "subject.py", "reference.py", "judge.py", "check_report.py", "options.py", "scenarios/base.py",
    "scenarios/decode.py", "scenarios/resume.py", "scenarios/rollback.py", "scenarios/fork.py",
)  # fmt: skip


def test_the_checker_validates_logits_only_through_model_calls():
    """Every model call of the checker returns validated logits through ``ModelCalls`` (kvfast/check/protocol.py):
    no other checker module calls ``check_logits`` or a model's logits method itself."""
    for name in CHECKER:
        tree = ast.parse((ROOT / "kvfast" / "check" / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Name | ast.alias):
                assert getattr(node, "id", getattr(node, "name", None)) != "check_logits", name
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in ("prefill", "extend", "decode", "recompute", "recompute_variants"):
                    receiver = node.func.value
                    assert isinstance(receiver, ast.Name | ast.Attribute), name
                    text = ast.unparse(receiver)
                    assert text.endswith("calls"), f"{name}: {ast.unparse(node)} is not a ModelCalls call"


def test_no_function_of_the_check_package_is_over_80_lines():
    long = []
    for path in sorted((ROOT / "kvfast" / "check").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    long.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


# --- promote and strict: one name, one type, validated in CheckOptions ---------------------------------


def test_promote_is_none_or_a_name_of_promote_and_nothing_else():
    assert PROMOTE == ("float64",)
    assert CheckOptions(4).promote is None and CheckOptions(4, promote="float64").promote == "float64"
    for bad in (True, "float32", "", 64, ["float64"]):
        with pytest.raises(ValueError) as exc:
            CheckOptions(4, promote=bad)
        assert str(exc.value) == f"promote: {bad!r} is not allowed; allowed: float64"


def test_strict_is_a_bool_off_by_default():
    assert CheckOptions(4).strict is False and CheckOptions(4, strict=True).strict is True
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError) as exc:
            CheckOptions(4, strict=bad)
        assert str(exc.value) == f"strict: {bad!r} is not allowed; allowed: True or False"


def test_an_option_that_is_no_field_is_a_value_error_listing_the_fields():
    with pytest.raises(ValueError) as exc:
        CheckOptions.defaulting_steps(stric=True)
    names = ", ".join(f.name for f in dataclasses.fields(CheckOptions))
    assert str(exc.value) == f"options: 'stric' is not allowed; allowed: {names}"


# --- the command line's flags: one per CheckOptions field ----------------------------------------------


def parsed(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["check", "m:f", "--prompt", "1,2,3", *argv])


def options_of(*argv: str) -> CheckOptions:
    from kvfast.commands.check import check_options

    return check_options(parsed(*argv))


def test_every_field_but_keep_logits_has_a_flag_with_help(capsys):
    python_only = {f.name for f in dataclasses.fields(CheckOptions)} - set(flags())
    assert python_only == {"keep_logits"}  # the logits stay in the report object: nothing to print
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["check", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    args = parsed()
    for name, flag in flags().items():
        assert flag.name in text and " ".join(flag.help.split()) in text, name
        assert getattr(args, name, "absent") is None, name  # its dest is the field; not given: the field's default
    for kept in ("--per-step", "--scenarios", "--continuation", "--split", "--margin", "--decisive", "--mode"):
        assert kept in text
    for flag in ("--steps", "--timeout", "--promote", "--strict"):
        assert flag in text


@pytest.mark.subprocess
def test_only_the_check_command_reads_the_options_module():
    """The other commands never pay the checker's imports (numba): the flags are added when ``check`` is parsed."""
    code = (
        "import sys; from kvfast.cli import build_parser; parser = build_parser(); "
        "print('kvfast.check' in sys.modules); parser.parse_args(['check', 'm:f', '--prompt', '1']); "
        "print('kvfast.check.options' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "True"]


def test_the_flags_build_the_options():
    assert options_of() == CheckOptions(DEFAULT_STEPS)
    assert options_of("--per-step", "--mode", "control", "--decisive", "20", "--promote") == CheckOptions(
        64, "control", fast=False, decisive=20.0, promote="float64"
    )
    assert options_of("--promote", "float64", "--mode", "control").promote == "float64"
    assert options_of("--continuation", "7,8,9", "--scenarios", "resume") == CheckOptions(
        3, scenarios="resume", continuation=(7, 8, 9)
    )
    assert options_of("--scenarios", "decode, rollback").scenarios == ("decode", "rollback")
    assert options_of("--strict").strict is True and options_of().strict is False
    got = options_of("--steps", "5", "--split", "1", "--margin", "2", "--follow", "cache", "--timeout", "3")
    assert got == CheckOptions(5, split=1, margin=2.0, follow="cache", timeout=3.0)


def test_the_childs_options_are_the_parents():
    """The child process reads the flags back from JSON (tuples become lists): the same options."""
    from kvfast.commands.check import check_options

    args = parsed("--continuation", "7,8,9", "--scenarios", "resume,decode", "--promote", "--strict", "--per-step")
    sent = json.loads(json.dumps({k: v for k, v in vars(args).items() if k != "func"}))
    assert check_options(argparse.Namespace(**sent)) == check_options(args)


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """``kvfast ARGV``'s exit code (argparse's own errors exit) and stderr."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--promote", "float32"], "argument --promote: invalid choice: 'float32'"),
        (["--steps", "x"], "argument --steps: 'x' is not allowed; allowed: an integer"),
        (["--split", "1.5"], "argument --split: '1.5' is not allowed; allowed: an integer"),
        (["--margin", "wide"], "argument --margin: 'wide' is not allowed; allowed: a number"),
        (["--continuation", "4,a"], "argument --continuation: 'a' is not an integer"),
        (["--mode", "loose"], "argument --mode: invalid choice: 'loose'"),
        (["--follow", "mine"], "argument --follow: invalid choice: 'mine'"),
        (["--steps", "0"], "--steps: 0 is not allowed; allowed: an integer >= 1"),
        (["--margin", "nan"], "--margin: nan is not allowed; allowed: a finite number >= 1"),
        (["--decisive", "2"], "--decisive: 2.0 is not allowed; allowed: a finite number >= 4"),
        (["--scenarios", "decode,warp"], "--scenarios: 'warp' is not allowed"),
        (["--follow", "cache", "--mode", "control"], "--follow: 'cache' is not allowed with mode='control'"),
        (["--timeout", "-1"], "--timeout: -1.0 is not allowed"),
        (["--steps", "4", "--continuation", "1,2"], "--steps: 4 is not allowed; allowed: an integer >= 1, <= 2"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it_and_exit_2_before_any_import(argv, needle, capsys):
    """The factory's module does not exist: the flag is refused first, before the check's process starts."""
    code, err = run_cli(["check", "no_such_module_kv:make", "--prompt", "1,2,3", *argv], capsys)
    assert code == 2
    assert needle in err and err.count("\n") == 1, err


# --- the model's declarations: lossy_cache of the wrong type refused, every read the model's code ------------

CFG8 = ModelConfig(vocab=32, d_model=16, n_head=2, n_layer=1, d_ff=32, max_pos=48)


class DeclaresLossy:
    """kvfast's correct int8 cache behind a ``lossy_cache`` declaration of the test's choosing."""

    def __init__(self, declared):
        self.inner = LossyKvfastModel(CFG8, init_params(CFG8, 0), "f64", fmt="int8")
        self.lossy_cache = declared

    def recompute(self, tokens):
        return self.inner.recompute(tokens)

    def prefill(self, tokens):
        return self.inner.prefill(tokens)

    def decode(self, token):
        return self.inner.decode(token)

    def lossless(self):
        return self.inner.lossless()


def test_the_declared_lossy_formats_are_those_the_round_trip_takes():
    x = np.random.default_rng(0).standard_normal((3, 8))
    for fmt in DECLARED_FORMATS:
        assert round_trip(fmt, x, 1.0).shape == x.shape, fmt
    for fmt in ("int1", "int9", "fp4"):
        with pytest.raises(ValueError):
            round_trip(fmt, x, 1.0)


def test_a_correct_int8_cache_declared_so_is_lossy():
    assert check_cache(DeclaresLossy("int8"), PROMPT, 3).verdict == "lossy"


@pytest.mark.parametrize("declared", [8, "", ["int8"], "int8 "])
def test_a_lossy_cache_of_the_wrong_type_is_one_line_naming_the_field(declared):
    """Before: silently ignored, and a correct int8 cache then judged lossless (divergent)."""
    with pytest.raises(ValueError) as exc:
        check_cache(DeclaresLossy(declared), PROMPT, 3)
    allowed = "None or a format name: int8, fp8, fp8-tensor, int2, int3, int4, int5, int6, int7"
    assert str(exc.value) == f"model.lossy_cache: {declared!r} is not allowed; allowed: {allowed}"


def test_int3_on_kvfasts_own_cache_is_still_refused():
    with pytest.raises(ValueError, match="fmt: 'int3' is not allowed; allowed: int8, fp8$"):
        check_cache(DeclaresLossy("int3"), PROMPT, 3)


@pytest.mark.parametrize("bad", [{"kv cache": 8}, ["float16"], "float16", {"kv cache": "float12"}])
def test_internal_formats_of_the_wrong_type_are_one_line_naming_the_field(bad):
    class Declares(Toy):
        internal_formats = bad

    with pytest.raises(ValueError, match=r"^model\.internal_formats: .* is not allowed; allowed: a dict"):
        check_cache(Declares(), [1, 2, 3], 3, mode="control")


class BrokenMapping(Mapping):
    """A mapping whose reading raises (the model's own code)."""

    def __getitem__(self, key):
        raise KeyError(key)

    def __iter__(self):
        raise RuntimeError("formats unavailable")

    def __len__(self):
        return 1


def raising(name: str) -> Toy:
    """A Toy whose attribute ``name`` raises when read."""

    def broken(self):
        raise RuntimeError(f"{name} unavailable")

    return type(f"Raising_{name}", (Toy,), {name: property(broken)})()


@pytest.mark.parametrize("name", ["internal_formats", "lossy_cache", "vocab_size", "max_positions"])
@pytest.mark.parametrize("mode", ["exact", "control"])
def test_an_attribute_that_raises_when_read_is_the_models_failure(name, mode):
    with pytest.raises(ModelUnderTestError) as exc:
        check_cache(raising(name), [1, 2, 3], 3, mode=mode)
    assert str(exc.value) == f"model.{name} raised RuntimeError: {name} unavailable"


def test_a_mapping_that_raises_when_read_is_the_models_failure():
    class Declares(Toy):
        internal_formats = BrokenMapping()

    with pytest.raises(ModelUnderTestError) as exc:
        check_cache(Declares(), [1, 2, 3], 3, mode="control")
    assert str(exc.value) == "model.internal_formats raised RuntimeError: formats unavailable"


def test_a_method_that_raises_when_read_is_the_models_failure():
    with pytest.raises(ModelUnderTestError, match=r"^model\.extend raised RuntimeError: extend unavailable$"):
        check_cache(raising("extend"), [1, 2, 3], 3)


CLI_MODELS = """
from collections.abc import Mapping
from kvfast import ModelConfig, init_params
from kvfast.check.lossy import LossyKvfastModel
from toymodels import Toy

CFG = ModelConfig(vocab=32, d_model=16, n_head=2, n_layer=1, d_ff=32, max_pos=48)


class Broken(Mapping):
    def __getitem__(self, key):
        raise KeyError(key)

    def __iter__(self):
        raise RuntimeError("formats unavailable")

    def __len__(self):
        return 1


class BrokenFormats(Toy):
    internal_formats = Broken()


def broken_formats():
    return BrokenFormats()


def lossy_eight():
    model = LossyKvfastModel(CFG, init_params(CFG, 0), "f64", fmt="int8")

    class Declares:
        lossy_cache = 8
        recompute, prefill, decode, lossless = model.recompute, model.prefill, model.decode, model.lossless

    return Declares()
"""


@pytest.fixture
def cli_models(tmp_path, monkeypatch):
    (tmp_path / "toymodels.py").write_text((ROOT / "tests" / "toymodels.py").read_text())
    (tmp_path / "declaring.py").write_text(CLI_MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "declaring"


@pytest.mark.subprocess
def test_kvfast_check_refuses_a_lossy_cache_of_8_with_exit_2(cli_models, capsys):
    code, err = run_cli(["check", f"{cli_models}:lossy_eight", "--prompt", "1,2,3", "--steps", "3"], capsys)
    assert code == 2
    assert err.startswith("kvfast: error: model.lossy_cache: 8 is not allowed; allowed: None or a format name:")
    assert err.count("\n") == 1, err


@pytest.mark.subprocess
def test_kvfast_check_calls_internal_formats_that_raise_the_models_failure(cli_models, capsys):
    """Before: exit 70, "a bug in kvfast", with a traceback."""
    argv = ["check", f"{cli_models}:broken_formats", "--prompt", "1,2,3", "--steps", "3", "--mode", "control"]
    code, err = run_cli(argv, capsys)
    assert code == 4
    assert err == (
        "kvfast: error: the model under test failed: model.internal_formats raised RuntimeError: formats unavailable\n"
    )


# --- kv_check: every failure is one line ---------------------------------------------------------------


def test_every_kv_check_failure_but_a_report_is_one_line(pytester):
    """Bad input, the model's failure, a timeout: one line each, no exception chain ("During handling of the
    above exception"); a failing report is the report (several lines)."""
    pytester.makepyfile(toymodels=(ROOT / "tests" / "toymodels.py").read_text())
    pytester.makepyfile(
        test_kv="""
        import time
        from toymodels import Toy

        class Boom(Toy):
            def decode(self, token):
                raise ZeroDivisionError("weights of zero norm")

        class Hang(Toy):
            def decode(self, token):
                while True:
                    time.sleep(0.05)

        def test_bad_prompt(kv_check):
            kv_check(Toy(), prompt=[], steps=4)

        def test_bad_option(kv_check):
            kv_check(Toy(), prompt=[1, 2, 3], steps=4, strict="yes")

        def test_no_such_option(kv_check):
            kv_check(Toy(), prompt=[1, 2, 3], steps=4, stric=True)

        def test_boom(kv_check):
            kv_check(Boom(), prompt=[1, 2, 3], steps=4)

        def test_hang(kv_check):
            kv_check(Hang(), prompt=[1, 2, 3], steps=4, timeout=1)

        def test_report(kv_check):
            kv_check(Toy("posfrozen"), prompt=[1, 2, 3], steps=4)

        def test_strict_passes_through(kv_check):
            assert kv_check(Toy(), prompt=[1, 2, 3], steps=4, strict=True).verdict == "exact"
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-rN")
    result.assert_outcomes(passed=1, failed=6)
    sections = failure_sections(result.stdout.lines)
    expected = {
        "test_bad_prompt": "kv_check: bad input: prompt: shape (0,) is not allowed",
        "test_bad_option": "kv_check: bad input: strict: 'yes' is not allowed; allowed: True or False",
        "test_no_such_option": "kv_check: bad input: options: 'stric' is not allowed",
        "test_boom": "kv_check: the model under test failed: model.decode(",
        "test_hang": "kv_check: the check did not finish within 1 s: model.decode(",
    }
    for name, start in expected.items():
        assert len(sections[name]) == 1 and sections[name][0].startswith(start), sections[name]
    assert len(sections["test_report"]) > 3 and "first bug step" in "\n".join(sections["test_report"])


def failure_sections(lines: list[str]) -> dict[str, list[str]]:
    """``{test name: the lines of its failure}`` from pytest's FAILURES section."""
    out: dict[str, list[str]] = {}
    current = None
    for line in lines:
        if line.startswith("____") and line.endswith("____"):
            current = line.strip("_ ")
            out[current] = []
        elif line.startswith("===="):
            current = None
        elif current is not None and line.strip():
            out[current].append(line)
    return out
