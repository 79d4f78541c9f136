"""kvfast's pytest plugin: the ``kv_check`` fixture (registered through the ``pytest11`` entry point).

Installing kvfast is enough; in a test::

    def test_my_cache(kv_check):
        kv_check(MyModel(), prompt=[1, 2, 3], steps=64)                 # exact at every step
        kv_check(MyModel(), prompt=[1, 2, 3], steps=64, mode="control")  # rounding or bug

``kv_check(model, prompt, steps=64, mode="exact", **options)`` runs
:func:`kvfast.check_cache` (options: ``scenarios``, ``fast``, ``split``,
``margin``, ``window``) and returns the report; when the check fails the
test fails with the report: the first divergent step, its deviation, the
context tokens and a short per-step table. Bad input (a model without a
required method, bad logits, a bad prompt) fails the test with
``kv_check: bad input:`` and the ``ValueError``'s message.

This module imports nothing heavy at import time (kvfast's checker is imported
when the fixture is first used), so the plugin never slows down or breaks
pytest sessions that do not use it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest


@pytest.fixture
def kv_check() -> Callable:
    """A function ``kv_check(model, prompt, steps=64, mode="exact", **options) -> CheckReport``; see the module."""

    def run(model, prompt, steps: int = 64, mode: str = "exact", **options):
        from kvfast.check.checker import check_cache

        try:
            report = check_cache(model, prompt, steps, mode=mode, **options)
        except ValueError as exc:
            pytest.fail(f"kv_check: bad input: {exc}", pytrace=False)
        if not report.passed:
            pytest.fail(report.format(), pytrace=False)
        return report

    return run
