"""Bugs of kvfast's own lossy cache (:class:`~kvfast.check.lossy.LossyKvfastModel`): what it stores is worse
than it declares. ``inject_lossy_bug(LossyKvfastModel(config, params, fmt="int8"), "int4")``."""

from __future__ import annotations

from kvfast.bugs.bug import Bug, Catalogue, mixin_injector, subclass_with
from kvfast.check.lossy import LossyKvfastModel


class _StoresInt4:
    lossy_bug = "int4"

    def _stored_format(self) -> str:
        return "int4"

    def promote(self, dtype: str = "float64"):
        return subclass_with(super().promote(dtype), _StoresInt4)  # the promoted model keeps the bug

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, lossy_bug={self.lossy_bug!r})"


_inject_int4 = mixin_injector(LossyKvfastModel, "a LossyKvfastModel")(_StoresInt4)

#: The lossy cache's bugs: each changes every stored row, so it first acts where a call first reads stored rows:
#: decode step 1, or a resume's second chunk (step 0); a prefill attends its fresh rows.
LOSSY_BUGS = Catalogue(
    Bug(
        "int4", "declares int8 but stores 4 bits (scale absmax / 7)",
        lambda s, t, n, w: 0 if s == "resume" else 1, _inject_int4, logic=False,
    ),
    field="lossy_bug",
)  # fmt: skip


#: ``inject_lossy_bug(model, bug)``: the :class:`~kvfast.check.lossy.LossyKvfastModel` ``model`` with lossy-cache
#: bug ``bug`` of :data:`LOSSY_BUGS` (``None``: clean), in place and returned.
inject_lossy_bug = LOSSY_BUGS.inject
