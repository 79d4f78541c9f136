"""``kvfast check PACKAGE.MODULE:FACTORY --prompt 1,2,3 --steps 64 [--mode auto|exact|control] [options]``.

Imports ``PACKAGE.MODULE`` (the current directory is searched first), calls
``FACTORY(**factory_args)`` (any callable, a class included; ``--factory-arg
key=value``, repeatable, values read as Python literals where they parse, else
as strings) to build a model under test (:mod:`kvfast.check.protocol`) or a
Hugging Face causal LM, and runs :func:`kvfast.check_cache` on it. Prints the
report. The check's flags are the fields of :class:`kvfast.check.CheckOptions`
(each declares its flag: :func:`add_option_flags`), validated by it in this
process before the child process starts.

Exit codes (:data:`EXIT_CODES`): 0 only when a report was printed and says
pass; 1 when it finds a bug (or the float64 logic check of ``--promote``
does), or a divergence in exact mode; 2 for bad input (a bad spec or argument, a
module or factory that cannot be found, a factory that returns no model under
test, a model missing a method, bad logits, a bad prompt), one line; 3 when
the verdict is inconclusive (and no logic check cleared it); 4 when
the model under test, its factory or its module raised or exited
(``SystemExit``, ``sys.exit(0)`` included, ``KeyboardInterrupt``, any other
exception, ``os._exit``, a crash or a signal), one line naming the call and
the exception; 5 when the check did not finish within ``--timeout``; 6 when
the recompute itself depends on the sequence's length (verdict
``length-dependent``: no cache can equal it); 7 when no requested scenario
ran (verdict ``unchecked``: the model lacks or declines every one's hooks) or,
with ``--strict``, when any was skipped; 70 for a bug in kvfast (a traceback,
the version and a line saying so); 130 when the user interrupts it (Ctrl-C).

Isolation. The check runs in a child process (``python -c``, the same
interpreter and ``sys.path``, its own session) that reports back through a
file; this process only validates the arguments, waits and prints. A model
that calls ``os._exit(0)`` or crashes ends the child without a report, which
can never read as a pass; a hang past ``--timeout`` that the in-process timer
cannot interrupt (C code) is ended by killing the child's process group, and
the child kills its group when this process dies, so no process outlives the
check (the mechanics: :mod:`kvfast.runtime.child`; the factory is loaded by
:func:`kvfast.runtime.load_object`'s rules).

``--repro DIR``: a bug found is reported first. The child sends the report as soon as the check ends
(:func:`kvfast.runtime.child.child_report`); this process prints it, and its exit code is final. Then the
child writes a reproducer per failing scenario (:func:`kvfast.repro.findings.reproduce_report`; each shrunk in
a process of its own, killed at its bound: :func:`kvfast.repro.shrink.shrink_apart`) and this process prints
their lines, or one line on stderr where they did not finish within their bound
(:func:`kvfast.repro.findings.bound_seconds`) or their process died; a reproducer that cannot be written is a
line too. DIR is checked before the check (exit 2): it must not exist yet or be empty.

Start-up. This process parses and validates the arguments without importing Numba or the checker; bad input
is refused before the child starts. kvfast's own factory ``kvfast.studies.check:kvfast_model`` is loaded from
the module that defines it (:data:`OWN_FACTORIES`), not through the studies (the sweep engine, pandas).

Built in: ``kvfast.bugs.kvfast_model:tiny_model`` (kvfast's own small model; ``--factory-arg bug=posfrozen``) and
``kvfast.testing:tiny_model`` (a tiny random Hugging Face model; ``--factory-arg family=gpt2 --factory-arg
dtype=bfloat16``).
"""

from __future__ import annotations

import argparse
import sys

from kvfast.commands import EXIT_INTERRUPTED, EXIT_KVFAST_BUG, bug_line

EXIT_PASS, EXIT_FAIL, EXIT_BAD_INPUT, EXIT_INCONCLUSIVE, EXIT_MODEL, EXIT_TIMEOUT = 0, 1, 2, 3, 4, 5
EXIT_LENGTH_DEPENDENT = 6
EXIT_UNCHECKED = 7
EXIT_CODES = {
    EXIT_PASS: "pass: a report was printed and its verdict passes (`exact`, `rounding`)",
    EXIT_FAIL: "a `bug` (the float64 logic check of `--promote` included), or a divergence in `--mode exact`",
    EXIT_BAD_INPUT: "bad input, one line: an argument, the factory spec, a module that cannot be imported, "
    "a factory that rejects its arguments or returns no model under test, bad logits, a bad prompt, more steps "
    "than the model has positions, a missing optional extra (the pip command that installs it), a working "
    "directory that no longer exists, a `--repro` folder that is a file, holds files, cannot be written or is not "
    "named in UTF-8 (before the check)",
    EXIT_INCONCLUSIVE: "`inconclusive` (between rounding and a bug), and no float64 logic check cleared it",
    EXIT_MODEL: "the model under test, its factory or its module raised or exited, one line naming the call "
    "and the exception: `SystemExit` (`sys.exit(0)` too), `KeyboardInterrupt`, any exception, `os._exit`, a crash",
    EXIT_TIMEOUT: "the check did not finish within `--timeout S` seconds, one line naming the call that hung",
    EXIT_LENGTH_DEPENDENT: "`length-dependent`: the recompute itself changes with the sequence's length by more "
    "than rounding (dynamic NTK, LongRoPE, or a wrong recompute); no cache can equal it; the report's second "
    "line names the row, the two lengths and the size",
    EXIT_UNCHECKED: "`unchecked`: no requested scenario ran (each one's hooks are missing or declined), or with "
    "`--strict` one was skipped; the report's second line names the scenarios and why",
    EXIT_KVFAST_BUG: "a bug in kvfast: its traceback, the kvfast version and a line saying so",
    EXIT_INTERRUPTED: "interrupted by the user (Ctrl-C); the check's processes were killed",
}
#: ``--engine NAME PATH``: the factory that builds NAME's model under test from ``path=PATH``.
ENGINES = {"ort": "kvfast.check.engines.ort:ORTModel", "llamacpp": "kvfast.check.engines.llamacpp:LlamaCppModel",
           "vllm": "kvfast.check.engines.vllm:VLLMModel",
           "transformer_lens": "kvfast.check.engines.transformer_lens:engine_model"}  # fmt: skip
GRACE_S = 1.5  # after --timeout, the child's own timer has had this long to report before it is killed
#: kvfast's own factories, by the module that defines them: ``kvfast.studies.check`` re-exports
#: ``kvfast_model`` for its grids, and importing it imports every study, the sweep engine and pandas (about
#: 1.4 s); the child loads the same function from its home (``tests/check/test_check_startup.py`` pins that it is
#: the same object)
OWN_FACTORIES = {"kvfast.studies.check:kvfast_model": "kvfast.bugs.kvfast_model:kvfast_model"}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "check",
        help="check a model's KV cache against its recompute at every step",
        description="Check a model's KV cache against its full recompute at every decode step. FACTORY is an "
        "importable callable (package.module:callable, looked up from the current directory first) that returns "
        "a model under test or a Hugging Face causal LM; with --engine, the path of an engine's model. The "
        "report's first line is the verdict (kvfast check: PASS: EXACT, PASS: ROUNDING, FAIL: BUG in scenario "
        "... at step ...), and the exit code says the same: 0 pass, 1 bug, 2 bad input, 3 inconclusive, 4 the "
        "model failed, 5 timeout, 6 length-dependent, 7 unchecked, 70 a bug in kvfast.",
    )
    p.add_argument(
        "factory", metavar="PACKAGE.MODULE:FACTORY",
        help="a callable that builds the model (with --engine: the engine's model path)",
    )  # fmt: skip
    p.add_argument(
        "--engine", choices=sorted(ENGINES), default=None,
        help="check an inference engine's model: FACTORY is then its path (ort: an onnxruntime-genai model directory; "
        "llamacpp: a GGUF file; vllm: a model directory; transformer_lens: a JSON file of HookedTransformerConfig "
        "fields, or a transformers model directory for a TransformerBridge)",
    )  # fmt: skip
    p.add_argument(
        "--factory-arg", action="append", default=[], metavar="KEY=VALUE", help="an argument for FACTORY (repeatable)"
    )
    p.add_argument("--prompt", required=True, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument(
        "--repro", default=None, metavar="DIR",
        help="on a bug: a shrunk standalone reproducer per failing scenario in DIR/SCENARIO/ (kvfast.repro), written "
        "after the report; DIR must not exist yet or be empty (a reproducer is never overwritten)",
    )  # fmt: skip
    p.add_argument(
        "--repro-seconds", type=int, default=60, metavar="S",
        help="the time budget of shrinking each one (default 60); its process is killed 30 s after it",
    )  # fmt: skip
    add_option_flags_on_use(p)
    p.set_defaults(func=run)


def add_option_flags_on_use(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` the flags of :class:`~kvfast.check.options.CheckOptions`' fields when it is first used
    (parsing ``kvfast check ...`` or its ``--help``): they are read from the options module, whose package
    costs a second of imports that the other commands never pay."""
    parse = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        parser.parse_known_args = parse  # once: from now on the parser has the flags
        add_option_flags(parser)
        return parse(args, namespace)

    parser.parse_known_args = parse_known_args


def add_option_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`~kvfast.check.options.CheckOptions` field with a :class:`~kvfast.check.options.Flag`
    (its ``dest`` the field's name, ``None`` when not given: the field's default); bad text is one line naming
    the flag (exit 2), bad values are :class:`CheckOptions`' (:func:`check_options`)."""
    from kvfast.check.options import flags

    for name, flag in flags().items():
        kwargs: dict = {"dest": name, "default": None, "help": flag.help}
        if flag.bare is not None and flag.choices is None:
            kwargs.update(action="store_const", const=flag.bare)
        else:
            kwargs.update(choices=flag.choices, metavar=flag.metavar)
            if flag.parse is not None:
                kwargs["type"] = _flag_text(flag.parse)
            if flag.bare is not None:
                kwargs.update(nargs="?", const=flag.bare)
        parser.add_argument(flag.name, **kwargs)


NUMBERS = {int: "an integer", float: "a number"}  # what int and float read, for their flags' messages


def _flag_text(parse):
    """``parse`` for argparse: bad text is one line, ``argument --FLAG: '...' is not allowed; allowed: ...``
    (``parse``'s own ``ValueError`` message; ``int`` and ``float``: :data:`NUMBERS`)."""

    def read(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            why = f"{text!r} is not allowed; allowed: {NUMBERS[parse]}" if parse in NUMBERS else str(exc)
            raise argparse.ArgumentTypeError(why) from None

    return read


def parse_prompt(text: str, flag: str = "--prompt") -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]``; ``ValueError`` naming ``flag`` and the bad item."""
    from kvfast.check.options import parse_tokens

    try:
        return list(parse_tokens(text))
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None


def parse_factory_args(items: list[str]) -> dict[str, object]:
    """``["seed=1", "family=gpt2"]`` -> ``{"seed": 1, "family": "gpt2"}`` (Python literals where they parse)."""
    import ast

    from kvfast.validation import not_allowed

    out: dict[str, object] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise not_allowed("--factory-arg", item, "KEY=VALUE with KEY a Python identifier")
        if key in out:
            raise not_allowed("--factory-arg", item, f"each key once ({key!r} repeats)")
        try:
            out[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[key] = text
    return out


def build_model(spec: str, factory_args: dict[str, object]):
    """``FACTORY(**factory_args)`` for ``spec`` (the callable ``PACKAGE.MODULE:FACTORY`` names, by
    :func:`kvfast.runtime.load_object`'s rules and messages); ``ValueError`` (bad input) if it cannot be found,
    the arguments do not fit its signature or the factory raises ``ValueError`` (its verdict on them), else
    :class:`~kvfast.check.protocol.ModelUnderTestError` if the factory (or its module) raises or exits."""
    import inspect

    from kvfast.check.protocol import ModelUnderTestError, call_model
    from kvfast.runtime import load_object
    from kvfast.validation import not_allowed

    factory = load_object(
        OWN_FACTORIES.get(spec, spec),
        "factory",
        accept=callable,
        allowed="a callable (a function or class) that returns a model under test",
        form="PACKAGE.MODULE:FACTORY",
        error=ModelUnderTestError,
    )
    try:
        inspect.signature(factory).bind(**factory_args)
    except TypeError as exc:
        raise not_allowed("--factory-arg", factory_args, f"arguments {spec} takes ({exc})") from None
    except ValueError:  # no signature to read (a builtin): the call decides
        pass
    call = f"{spec}({', '.join(f'{k}={v!r}' for k, v in factory_args.items())})"
    try:
        model = call_model(f"the factory {call}", factory, **factory_args, passthrough=(ValueError,))
    except ValueError as exc:  # by convention, the factory's verdict on its arguments: bad input
        raise ValueError(f"{' '.join(str(exc).split())} (raised by the factory {call})") from exc
    require_model_under_test(model, call)
    return model


def require_model_under_test(model: object, call: str) -> None:
    """``ValueError`` (bad input: ``the factory CALL returns no model under test: ...``) unless ``model`` is a
    model under test, a Hugging Face model or an engine's object kvfast wraps by itself
    (:func:`kvfast.check.engines.engine_adapter`: a ``HookedTransformer``, a ``vllm.LLM``, ...): a class instead
    of an instance, ``None``, anything else."""
    from kvfast.check.engines import engine_adapter
    from kvfast.check.hf import is_hf_model
    from kvfast.check.protocol import require_model

    try:
        if not isinstance(model, type) and (is_hf_model(model) or engine_adapter(model) is not None):
            return
        require_model(model)
    except ValueError as exc:
        raise ValueError(f"the factory {call} returns no model under test: {exc}") from None


def check_args(args) -> None:
    """Every check of the arguments before the child gets its request (bad input before any work): the prompt, the
    factory's spec and arguments, and the options (:func:`check_options`)."""
    from kvfast.runtime import split_ref
    from kvfast.validation import not_allowed, require_int

    parse_prompt(args.prompt)
    factory_args = parse_factory_args(args.factory_arg)
    check_options(args)
    if getattr(args, "repro", None) is not None:
        from kvfast.repro.script import require_repro_dir

        require_int(getattr(args, "repro_seconds", 60), "--repro-seconds", 1)
        require_repro_dir(args.repro, "--repro")
    if getattr(args, "engine", None) is None:
        split_ref(args.factory, "factory", "PACKAGE.MODULE:FACTORY")
    elif "path" in factory_args:
        raise not_allowed("--factory-arg", "path=...", "no path: with --engine the path is the positional argument")


def check_options(args):
    """The check's :class:`~kvfast.check.options.CheckOptions` from the flags (each field's ``dest``; ``None``:
    not given, the field's default). A bad value is the options' ``ValueError`` with the field's name replaced
    by its flag's (``--steps: 0 is not allowed; ...``)."""
    from kvfast.check.options import CheckOptions, flags

    named = flags()
    given = {name: value for name in named if (value := getattr(args, name, None)) is not None}
    try:
        return CheckOptions.defaulting_steps(**given)
    except ValueError as exc:
        name, sep, rest = str(exc).partition(": ")
        raise ValueError(f"{named[name].name}: {rest}" if sep and name in named else str(exc)) from None


def run_check(args, started: float | None = None) -> dict:
    """The check itself (in the child): ``{"kind": ..., ...}`` for the parent (see :func:`child`)."""
    from dataclasses import replace

    from kvfast.check.check_report import UNCHECKED
    from kvfast.check.checker import check_cache_with
    from kvfast.check.protocol import CheckTimeout, ModelUnderTestError, watched

    try:
        options = replace(check_options(args), timeout=None)  # --timeout is this process's watch (below)
        with watched(args.timeout, started):
            spec, factory_args = args.factory, parse_factory_args(args.factory_arg)
            if getattr(args, "engine", None):  # --engine NAME PATH: NAME's adapter (ENGINES) over PATH
                spec, factory_args = ENGINES[args.engine], {"path": args.factory, **factory_args}
            model = build_model(spec, factory_args)
            report = check_cache_with(model, parse_prompt(args.prompt), options)
    except ValueError as exc:
        return {"kind": "bad input", "line": str(exc)}
    except ModelUnderTestError as exc:
        return {"kind": "model", "line": f"the model under test failed: {exc}"}
    except CheckTimeout as exc:
        return {"kind": "timeout", "line": str(exc)}
    if report.verdict == UNCHECKED:
        code = EXIT_UNCHECKED
    elif report.length_dependence is not None:
        code = EXIT_LENGTH_DEPENDENT
    elif report.passed:
        code = EXIT_PASS
    else:
        code = EXIT_INCONCLUSIVE if report.verdict == "inconclusive" else EXIT_FAIL  # bug, divergent, lossy (exact)
    result = {"kind": "report", "text": report.format(), "code": code}
    if code == EXIT_FAIL and getattr(args, "repro", None):
        return _reproducers(args, model, report, result)
    return result


def _reproducers(args, model, report, result: dict) -> dict:
    """``--repro DIR``: the check's ``result`` sent to the parent first (printed at once, its exit code final;
    with the seconds the reproducers get after it, :func:`kvfast.repro.findings.bound_seconds`), then a
    reproducer per failing scenario (:func:`kvfast.repro.findings.reproduce_report`), as lines after it:
    ``{"kind": "reproducers", "text": ...}``. Whatever fails here is a line, never the report's end."""
    from kvfast.repro.findings import bound_seconds, reproduce_report
    from kvfast.runtime.child import child_report
    from kvfast.validation import one_line, printable

    failing = [name for name, s in report.scenarios.items() if s.verdict in ("bug", "divergent")]
    sent = child_report({**result, "bound": bound_seconds(max(1, len(failing)), args.repro_seconds)})
    seed = parse_factory_args(args.factory_arg).get("seed", 0)
    lines = []
    try:
        found = reproduce_report(
            model, parse_prompt(args.prompt), report, args.repro, seconds=args.repro_seconds,
            seed=seed if isinstance(seed, int) else 0, command=getattr(args, "command_line", "kvfast check"),
        )  # fmt: skip
        for f in found:
            label = f" ({f.label}{': ' + f.reference if f.reference else ''})" if f.label else ""
            lines.append(f"reproducer, {f.scenario}: {f.reproducer or f.note}{label}")
            if f.stopped:
                lines.append(f"reproducer, {f.scenario}: not shrunk ({f.stopped}): it is the case as found")
    except Exception as exc:  # noqa: BLE001 - a bug in kvfast's reproducers: one line, the report stands
        lines.append(f"reproducers: none written: {type(exc).__name__}: {one_line(exc)} (a bug in kvfast)")
    text = "\n".join(printable(line) for line in lines)
    return {"kind": "reproducers", "text": text} if sent else {**result, "text": f"{result['text']}\n{text}"}


def _print_report(result: dict) -> float | None:
    """``--repro``: the check's report, printed as soon as the child sends it (before any reproducer is
    written); the seconds the child gets after it."""
    print(result["text"], flush=True)
    return result.get("bound")


def _after_report(outcome, one_line) -> int:
    """``--repro``, the report printed: the reproducers' lines, or one line saying why there are none (their
    process killed at its bound, crashed, or failed); the report's exit code, whatever happened after it."""
    report, result = outcome.report, outcome.result
    if result is not None and result["kind"] == "reproducers":
        if result["text"]:
            print(result["text"])
        return int(report["code"])
    if outcome.timed_out:
        why = f"not finished within {report['bound']:g} s after the report; their processes were killed"
    elif result is None:
        why = f"their process ended without writing them all ({outcome.ended()})"
    else:
        print(result.get("traceback", ""), end="", file=sys.stderr)
        why = f"their process failed ({one_line(result.get('line', result['kind']))})"
    print(f"kvfast: error: --repro: reproducers {why}; the report above stands", file=sys.stderr)
    return int(report["code"])


BOOT = (
    "import json, sys\n"
    "boot = json.loads(sys.argv[1])\n"
    "sys.path[:] = boot['path']\n"
    "from kvfast.commands.check import child\n"
    "child(boot)\n"
)


def child(boot: dict) -> None:
    """The child process (:func:`kvfast.runtime.child.run_in_child`): import kvfast's checker, read the request,
    run the check, write ``{"kind": ...}`` for the parent, exit 0.

    Kinds: ``report`` (``text``, ``code``), ``bad input``, ``model``, ``timeout`` (``line``), ``bug``
    (``traceback``). The request is ``{"args": ...}``, the parent's parsed and checked arguments (:func:`run`).

    ``--timeout`` counts from the moment kvfast itself is imported here (and the request read): the
    deadline is for the user's code, so a slow start of the interpreter and of kvfast on a loaded machine
    can never be blamed on the model or its module.
    """
    from kvfast.runtime.child import child_done, child_ready, child_started, read_request

    child_started(boot)
    import kvfast.check.checker  # noqa: F401 - kvfast's own start-up, before the deadline starts

    request = read_request(boot)
    started = child_ready(boot)
    try:
        result = run_check(argparse.Namespace(**request["args"]), started)
    except KeyboardInterrupt as exc:  # nobody else signals this process (its own session): the model did
        result = {"kind": "model", "line": f"the model under test failed: its process got {exc!r}"}
    except BaseException:  # noqa: BLE001 - anything else is kvfast's own bug, reported with its traceback
        import traceback

        result = {"kind": "bug", "traceback": traceback.format_exc()}
    child_done(boot, result)


def run(args) -> int:
    from kvfast.runtime.child import run_in_child
    from kvfast.validation import one_line

    check_args(args)
    request = {"args": {k: v for k, v in vars(args).items() if k != "func"}}
    request["args"]["command_line"] = " ".join(["kvfast", *sys.argv[1:]])
    try:
        outcome = run_in_child(BOOT, request, args.timeout, GRACE_S, on_report=_print_report if args.repro else None)
    except KeyboardInterrupt:
        print("kvfast: interrupted; the check's processes were killed", file=sys.stderr)
        return EXIT_INTERRUPTED
    if outcome.report is not None:  # --repro: the report is printed, its exit code final
        return _after_report(outcome, one_line)
    result = outcome.result
    if outcome.timed_out:
        why = "could not be interrupted (the model under test is stuck outside Python); its processes were killed"
        result = {"kind": "timeout", "line": f"the check did not finish within {args.timeout:g} s and {why}"}
    elif result is None:
        ended = f"ended the check's process without a report ({outcome.ended()}: os._exit, a crash or a signal)"
        result = {"kind": "model", "line": f"the model under test {ended}; nothing was checked to the end"}
    kind = result["kind"]
    if kind == "report":
        print(result["text"])
        return int(result["code"])
    if kind == "bug":
        print(result["traceback"], end="", file=sys.stderr)
        print(bug_line(), file=sys.stderr)
        return EXIT_KVFAST_BUG
    print(f"kvfast: error: {one_line(result['line'])}", file=sys.stderr)
    return {"bad input": EXIT_BAD_INPUT, "model": EXIT_MODEL, "timeout": EXIT_TIMEOUT}[kind]
