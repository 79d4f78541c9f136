"""``kvfast.repro``: every finding an upstream-ready reproducer (extra ``kvfast[hf]``).

A finding on a Hugging Face model becomes a :class:`~kvfast.repro.case.ReproCase` (:func:`find_case`), is shrunk to
the smallest case kvfast still calls ``bug`` (:func:`~kvfast.repro.shrink.shrink_case`), labelled ``known``,
``new`` or ``injected`` (:mod:`kvfast.repro.known`), and written as a standalone script that needs only torch
and transformers, with its issue text (:func:`write_reproducer`). Above :mod:`kvfast.check` and
:mod:`kvfast.bugs`, below the studies and the commands; the checker never imports it.
"""

from __future__ import annotations

from kvfast.repro.case import ReproCase, build_model, check_case, find_case
from kvfast.repro.known import KNOWN, label
from kvfast.repro.script import issue_text, render, write_reproducer

__all__ = [
    "KNOWN",
    "ReproCase",
    "build_model",
    "check_case",
    "find_case",
    "issue_text",
    "label",
    "render",
    "write_reproducer",
]
