"""Studies: run functions over configs, each with its schema, summary, claims and report figures (see
:mod:`kvfast.sweep.study`).

Every module of this package that defines ``STUDY`` is registered in :data:`STUDIES`.
"""

from __future__ import annotations

import importlib
import pkgutil

from kvfast.sweep.study import REGISTERED, Claim, Fact, Figure, Study


def _discover() -> dict[str, Study]:
    found: dict[str, Study] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        study = getattr(module, "STUDY", None)
        if isinstance(study, Study):
            found[study.name] = study
    return found


REGISTERED.register(_discover())
STUDIES: dict[str, Study] = REGISTERED  # the sweep's default registry itself: kvfast.sweep names no study

__all__ = ["STUDIES", "Claim", "Fact", "Figure", "Study"]
