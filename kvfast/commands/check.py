"""``kvfast check PACKAGE.MODULE:FACTORY --prompt 1,2,3 --steps 64 [--mode exact|control] [options]``.

Imports ``PACKAGE.MODULE`` (the current directory is searched first), calls
``FACTORY(**factory_args)`` (any callable, a class included; ``--factory-arg
key=value``, repeatable, values read as Python literals where they parse, else
as strings) to build a model under test (:mod:`kvfast.check.protocol`) or a
Hugging Face causal LM, and runs :func:`kvfast.check_cache` on it. Prints the
report. Exit code 0 when the check passes, 1 when it finds a divergence
(exact) or a bug (control, or the float64 logic check of ``--promote``), 3
when the control verdict is inconclusive (and no logic check cleared it), 2
for bad input (a bad spec or argument, a module or factory that cannot be
found, a model missing a method, bad logits, a bad prompt), before any work.

Built in: ``kvfast.check.hf:tiny_model`` (a tiny random Hugging Face model;
``--factory-arg family=gpt2 --factory-arg dtype=bfloat16``).
"""

from __future__ import annotations

import ast
import importlib
import os
import sys

from kvfast.validation import not_allowed


def add_parser(sub) -> None:
    p = sub.add_parser(
        "check",
        help="check a model's KV cache against its recompute at every step",
        description="Check a model's KV cache against its full recompute at every decode step.",
    )
    p.add_argument("factory", metavar="PACKAGE.MODULE:FACTORY", help="a callable that builds the model")
    p.add_argument(
        "--factory-arg", action="append", default=[], metavar="KEY=VALUE", help="an argument for FACTORY (repeatable)"
    )
    p.add_argument("--prompt", required=True, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--steps", type=int, default=None, help="decode steps to check (default 64, or the continuation's)")
    p.add_argument("--continuation", default=None, help="comma-separated token ids to feed instead of greedy ones")
    p.add_argument(
        "--mode",
        choices=["exact", "control"],
        default="exact",
        help="exact (==) or control (rounding/inconclusive/bug)",
    )
    p.add_argument("--scenarios", default="decode,resume", help="comma-separated: decode, resume (default both)")
    p.add_argument("--split", type=int, default=None, help="the resume scenario's split (default half the prompt)")
    p.add_argument("--margin", type=float, default=None, help="control: rounding up to this ratio (default 4)")
    p.add_argument("--decisive", type=float, default=None, help="control: bug beyond this ratio (default 16)")
    p.add_argument(
        "--promote", action="store_true", help="add the logic check: the same model in float64 (control mode)"
    )
    p.add_argument("--per-step", action="store_true", help="one recompute per step instead of the fast path")
    p.set_defaults(func=run)


def parse_prompt(text: str, flag: str = "--prompt") -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]``; ``ValueError`` naming the bad item."""
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t for t in items):
        raise ValueError(f"{flag}: {text!r} is not allowed; allowed: comma-separated token ids such as 1,2,3")
    out = []
    for t in items:
        try:
            out.append(int(t))
        except ValueError:
            raise ValueError(f"{flag}: {t!r} is not an integer; allowed: comma-separated token ids") from None
    return out


def parse_factory_args(items: list[str]) -> dict[str, object]:
    """``["seed=1", "family=gpt2"]`` -> ``{"seed": 1, "family": "gpt2"}`` (Python literals where they parse)."""
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


def load_factory(spec: str):
    """The callable named by ``PACKAGE.MODULE:FACTORY``; ``ValueError`` if it cannot be found."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"factory: {spec!r} is not allowed; allowed: PACKAGE.MODULE:FACTORY")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"factory: module {module_name!r} cannot be imported ({exc}); allowed: an importable module"
        ) from exc
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"factory: {module_name!r} has no attribute {attr!r}; allowed: a callable in that module")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"factory: {spec!r} is not callable; allowed: a function or class")
    return obj


def run(args) -> int:
    from kvfast.check.checker import check_cache

    prompt = parse_prompt(args.prompt)
    continuation = None if args.continuation is None else parse_prompt(args.continuation, "--continuation")
    steps = args.steps if args.steps is not None or continuation is not None else 64
    scenarios = tuple(s.strip() for s in args.scenarios.split(","))
    options = {name: getattr(args, name) for name in ("split", "margin", "decisive") if getattr(args, name) is not None}
    if args.promote:
        options["promote"] = "float64"
    factory_args = parse_factory_args(args.factory_arg)
    factory = load_factory(args.factory)
    try:
        model = factory(**factory_args)
    except TypeError as exc:
        raise not_allowed("--factory-arg", factory_args, f"arguments {args.factory} takes ({exc})") from exc
    report = check_cache(
        model, prompt, steps, mode=args.mode, scenarios=scenarios, fast=not args.per_step,
        continuation=continuation, **options,
    )  # fmt: skip
    print(report.format())
    if report.passed:
        return 0
    bug = report.verdict in ("bug", "divergent") or (report.promoted is not None and not report.promoted.passed)
    return 1 if bug else 3
