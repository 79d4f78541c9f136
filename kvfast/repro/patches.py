"""The kvfast source a standalone script carries verbatim: the cached path (:mod:`kvfast.check.hf_path`,
:func:`cached_path_source`) and an injected catalogue bug's mixin classes (:mod:`kvfast.bugs.hf_mixins`,
:func:`patch_for`), the very source the checker and the catalogues run, so the script, which never imports
kvfast, runs the same path and shows the same bug.

:data:`PATCHES`: ``{(catalogue, name): mixin class}``: every bug of both catalogues but ``static_never_cleared``
(a bug across several prefills of one ``StaticCache``, injected by replacing ``new_cache``, so neither seen in an
adapter nor carried): :func:`patch_for` says so.
"""

from __future__ import annotations

import inspect

from kvfast.bugs import hf_mixins
from kvfast.check import hf_path
from kvfast.validation import not_allowed

#: ``{(catalogue, bug): its mixin}`` for every bug a script can carry.
PATCHES: dict[tuple[str, str], type] = {
    (cls.catalogue, cls.bug): cls
    for cls in vars(hf_mixins).values()
    if isinstance(cls, type) and cls.__module__ == hf_mixins.__name__ and "bug" in vars(cls)
}


def cached_path_source() -> str:
    """The text of :mod:`kvfast.check.hf_path`, as the installed kvfast runs it."""
    return inspect.getsource(hf_path)


def patch_for(bug: tuple[str, str] | None) -> str:
    """The script text that carries ``bug`` (``""`` for none): its mixin and the mixin's bases, verbatim, then the
    script's path with the mixin in front; ``ValueError`` for a bug no script carries."""
    if bug is None:
        return ""
    found = PATCHES.get(tuple(bug))
    if found is None:
        allowed = ", ".join(f"{c}:{n}" for c, n in PATCHES)
        raise not_allowed("bug", f"{bug[0]}:{bug[1]}", f"a bug a standalone script can carry ({allowed})")
    from kvfast.bugs import CATALOGUES

    classes = [cls for cls in reversed(found.__mro__) if cls.__module__ == hf_mixins.__name__]
    head = (
        f"# INJECTED BUG (kvfast's catalogue {bug[0]!r}, {bug[1]!r}): {CATALOGUES[bug[0]][bug[1]].description}.\n"
        "# kvfast's own mixin (kvfast/bugs/hf_mixins.py), carried verbatim, put in front of GeneratePath:\n"
    )
    tail = f'class GeneratePath({found.__name__}, GeneratePath):\n    """GeneratePath with the injected bug."""\n'

    return "\n\n" + head + "\n\n".join(inspect.getsource(cls) for cls in classes) + "\n\n" + tail


def bug_of_adapter(adapter) -> tuple[str, str] | None:
    """``(catalogue, name)`` of the catalogue bug injected into ``adapter`` (by its mixins), ``None`` if clean.
    A bug injected otherwise than by a mixin (``static_never_cleared`` replaces ``new_cache``) is not seen."""
    for cls in type(adapter).__mro__:
        if cls.__module__ == hf_mixins.__name__ and "bug" in vars(cls):
            return (cls.catalogue, cls.bug)
    return None
