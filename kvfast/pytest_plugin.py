"""kvfast's pytest plugin: the ``kv_check`` fixture (registered through the ``pytest11`` entry point).

Installing kvfast is enough; in a test::

    def test_my_cache(kv_check):
        kv_check(MyModel(), prompt=[1, 2, 3], steps=64)  # exact, or rounding; a bug fails the test

``kv_check(model, prompt, steps=64, mode="auto", **options)`` runs
:func:`kvfast.check_cache` (options: the fields of
:class:`kvfast.check.CheckOptions`: ``scenarios``, ``fast``, ``split``,
``margin``, ``decisive``, ``continuation``, ``promote``, ``follow``,
``keep_logits``, ``timeout``, ``strict``) and returns the report. ``model`` may be a Hugging Face causal LM (wrapped in
:class:`kvfast.check.hf.HFModel`). In the default mode (``auto``) a cache that
equals the recompute bit for bit is ``exact``; otherwise each step is judged
against the model's measured order noise (``rounding``, ``inconclusive`` or
``bug``); ``mode="exact"`` asks for ``==`` at every step. When the check fails
(a bug, a divergence in exact mode, or an ``inconclusive`` verdict that no
float64 logic check cleared) the test fails with the report: its first line
says the verdict, the scenario and the step; then by how much, the context
tokens and a short per-step table. Every other
failure fails the test with one line and no traceback:

- bad input (a model without a required method, bad logits, a bad prompt,
  an option that is no field of :class:`kvfast.check.CheckOptions`):
  ``kv_check: bad input: `` and the ``ValueError``'s message;
- the model's own code raised or exited (``SystemExit``, ``sys.exit(0)``
  included, ``KeyboardInterrupt`` it raised itself, any other exception):
  ``kv_check: the model under test failed: model.decode(5) raised ...``
  (:class:`kvfast.check.ModelUnderTestError`);
- ``timeout=S`` passed: ``kv_check: the check did not finish within S s: ...``
  (:class:`kvfast.check.CheckTimeout`; a ``SIGALRM`` timer, so the test must
  run in the main thread, and C code that never returns cannot be
  interrupted: ``kvfast check --timeout`` kills a child process instead).

A Ctrl-C from the user still stops the session. A model that calls
``os._exit`` ends the pytest process itself (no in-process check can see
it; ``kvfast check`` runs the model in a child process and exits 4).

This module imports nothing heavy at import time (kvfast's checker is imported
when the fixture is first used), so the plugin never slows down or breaks
pytest sessions that do not use it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest


@pytest.fixture
def kv_check() -> Callable:
    """A function ``kv_check(model, prompt, steps=64, mode="auto", **options) -> CheckReport``; see the module
    (``steps`` defaults to the continuation's length when one is given)."""

    def run(model, prompt, steps: int | None = None, mode: str = "auto", **options):
        from kvfast.check.checker import check_cache_with
        from kvfast.check.options import CheckOptions
        from kvfast.check.protocol import CheckTimeout, ModelUnderTestError
        from kvfast.validation import one_line

        # what each failure's line says before the exception's own message
        said = {ValueError: "bad input: ", ModelUnderTestError: "the model under test failed: ", CheckTimeout: ""}
        failure = None
        try:
            report = check_cache_with(model, prompt, CheckOptions.defaulting_steps(steps, mode=mode, **options))
        except tuple(said) as exc:
            failure = "kv_check: " + next(text for kind, text in said.items() if isinstance(exc, kind)) + str(exc)
        if failure is not None:  # failed here, outside the except block: no exception chain
            pytest.fail(one_line(failure), pytrace=False)
        if not report.passed:
            pytest.fail(report.format(), pytrace=False)
        return report

    return run
