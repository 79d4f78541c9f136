"""Public names imported on first use (PEP 562): one rule for every package that exports lazily.

A package lists ``name -> defining module`` and sets ``__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)``;
importing the package then loads none of those modules, and the first access of a name imports its module and
caches the value in the package. With ``submodules=True`` an unknown name is also tried as a submodule not yet
imported (``kvfast.check.scenarios`` after ``import kvfast.check``). This module imports nothing but the standard
library: the command line and the pytest plugin import it before anything heavy.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_exports(
    package: str, exports: Mapping[str, str], submodules: bool = False
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose public names ``exports`` maps to their modules."""

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            if submodules:
                try:
                    return importlib.import_module(f"{package}.{name}")
                except ModuleNotFoundError as exc:
                    if exc.name != f"{package}.{name}":
                        raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
