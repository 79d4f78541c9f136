"""``kvfast check PACKAGE.MODULE:FACTORY --prompt 1,2,3 --steps 64 [--mode exact|control]``.

Imports ``PACKAGE.MODULE`` (the current directory is searched first), calls
``FACTORY()`` (any callable taking no arguments, a class included) to build a
model under test (:mod:`kvfast.check.protocol`) and runs
:func:`kvfast.check_cache` on it. Prints the report. Exit code 0 when the
check passes, 1 when it finds a divergence (exact) or a bug (control), 2 for
bad input (a bad spec, a module or factory that cannot be found, a model
missing a method, bad logits, a bad prompt).
"""

from __future__ import annotations

import importlib
import os
import sys


def add_parser(sub) -> None:
    p = sub.add_parser(
        "check",
        help="check a model's KV cache against its recompute at every step",
        description="Check a model's KV cache against its full recompute at every decode step.",
    )
    p.add_argument("factory", metavar="PACKAGE.MODULE:FACTORY", help="a zero-argument callable that builds the model")
    p.add_argument("--prompt", required=True, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--steps", type=int, default=64, help="decode steps to check (default 64)")
    p.add_argument("--mode", choices=["exact", "control"], default="exact", help="exact (==) or control (rounding/bug)")
    p.add_argument("--scenarios", default="decode,resume", help="comma-separated: decode, resume (default both)")
    p.add_argument("--per-step", action="store_true", help="one recompute per step instead of the fast path")
    p.set_defaults(func=run)


def parse_prompt(text: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]``; ``ValueError`` naming the bad item."""
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t for t in items):
        raise ValueError(f"--prompt: {text!r} is not allowed; allowed: comma-separated token ids such as 1,2,3")
    out = []
    for t in items:
        try:
            out.append(int(t))
        except ValueError:
            raise ValueError(f"--prompt: {t!r} is not an integer; allowed: comma-separated token ids") from None
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
        raise ValueError(f"factory: {spec!r} is not callable; allowed: a function or class taking no arguments")
    return obj


def run(args) -> int:
    from kvfast.check.checker import check_cache

    prompt = parse_prompt(args.prompt)
    scenarios = tuple(s.strip() for s in args.scenarios.split(","))
    factory = load_factory(args.factory)
    model = factory()
    report = check_cache(model, prompt, args.steps, mode=args.mode, scenarios=scenarios, fast=not args.per_step)
    print(report.format())
    return 0 if report.passed else 1
