"""Imports run one way through kvfast: no cycle, and no import from a layer to the right of the importer's.

Every import statement of every module is read from its source (an AST walk:
top-level imports, imports inside functions and under ``TYPE_CHECKING``
alike). A module may import from its own layer and from the layers to its
left. The layers, left to right:

0. **leaf**: ``kvfast._version``, ``kvfast._lazy``, ``kvfast.validation`` (they import nothing from kvfast)
   and ``kvfast.runtime.*`` (running the user's code: loading it, deadlines, child processes; it imports
   only ``kvfast.validation`` and ``kvfast._lazy``, its lazy exports).
1. **kernels**: ``kvfast.kernels.*`` and ``kvfast.numerics`` (the validated names of the kernels'
   format, order and attention codes).
2. **model**: ``kvfast.model.*``.
3. **check**: ``kvfast.check.*``, the product (``kvfast.check.metrics`` imports nothing from kvfast), and
   ``kvfast.testing`` (tiny random models for tests and examples; the engines' and the studies' too).
4. **bugs**: ``kvfast.bugs.*``, test tooling: the bug catalogues (they subclass the checker's adapters) and
   detector scoring. The checker never imports them.
4a. **repro**: ``kvfast.repro.*``, a finding as an upstream-ready reproducer (it reads reports and
   re-injects catalogue bugs; the checker and the catalogues never import it).
5. **sweep**: ``kvfast.sweep.*`` (grids, execution, Parquet, in-process runs; the ``Study`` contract and the
   registry studies register into: the sweep imports nothing from ``kvfast.studies``).
6. **studies**: ``kvfast.studies.*``.
7. **report**: ``kvfast.report.*`` (the claims table, quoted figures, plots and HTML page, from stored results).
8. **commands**: ``kvfast`` itself (a facade that imports its public names on first use),
   ``kvfast.cli``, ``kvfast.commands.*``, ``kvfast.kernel_bench``, ``kvfast.pytest_plugin`` and every
   ``__main__`` module (entry points: nothing imports them).

Importing ``a.b.c`` also runs the package ``a.b``'s ``__init__``, so an edge to a
module counts as an edge to each of its packages too (except the importer's own
packages, which are already running, and the ``kvfast`` facade).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvfast

ROOT = Path(kvfast.__file__).resolve().parent

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("leaf", ("kvfast._version", "kvfast._lazy", "kvfast.validation", "kvfast.runtime")),
    ("kernels", ("kvfast.kernels", "kvfast.numerics")),
    ("model", ("kvfast.model",)),
    ("check", ("kvfast.check", "kvfast.testing")),
    ("bugs", ("kvfast.bugs",)),
    ("repro", ("kvfast.repro",)),
    ("sweep", ("kvfast.sweep",)),
    ("studies", ("kvfast.studies",)),
    ("report", ("kvfast.report",)),
    ("commands", ("kvfast.cli", "kvfast.commands", "kvfast.kernel_bench", "kvfast.pytest_plugin")),
]
FACADE = "kvfast"


def module_files() -> dict[str, Path]:
    """Every module of kvfast by dotted name (a package by its own name)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = ("kvfast", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def layer_of(name: str) -> int:
    """The layer index of a module (``ValueError`` for a module the table above does not place)."""
    if name == FACADE or name.rsplit(".", 1)[-1] == "__main__":
        return len(LAYERS) - 1
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return index
    raise ValueError(f"module {name}: in no layer; add it to LAYERS in tests/test_layering.py")


def imported_modules(source: str, importer: str, is_package: bool, known: set[str]) -> set[str]:
    """The kvfast modules that ``source`` (module ``importer``) imports anywhere in its body."""
    found: set[str] = set()
    package = importer if is_package else importer.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import sub`` imports the submodule ``pkg.sub`` when there is one
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            if target != FACADE and not target.startswith(FACADE + "."):
                continue
            while target not in known and "." in target:  # ``import kvfast.x.y`` of a name, not a module
                target = target.rpartition(".")[0]
            found.add(target)
            # running ``a.b.c`` runs ``a.b``'s __init__ first, unless the importer is inside ``a.b``
            parent = target.rpartition(".")[0]
            while parent and parent != FACADE:
                if not (importer == parent or importer.startswith(parent + ".")):
                    found.add(parent)
                parent = parent.rpartition(".")[0]
    found.discard(importer)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the kvfast modules it imports."""
    files = module_files()
    known = set(files)
    return {
        name: imported_modules(path.read_text(), name, path.name == "__init__.py", known)
        for name, path in files.items()
    }


def right_to_left(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a layer to the right of the importer's, as readable lines."""
    bad = []
    for importer, targets in sorted(graph.items()):
        for target in sorted(targets):
            if layer_of(target) > layer_of(importer):
                bad.append(
                    f"{importer} ({LAYERS[layer_of(importer)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
                )
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: every strongly connected set of two or more modules (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_every_module_is_in_a_layer(graph):
    assert len(graph) > 40
    for name in graph:
        layer_of(name)


def test_no_import_runs_right_to_left(graph):
    assert right_to_left(graph) == []


def test_no_import_cycle(graph):
    assert cycles(graph) == []


def test_the_walk_sees_imports_inside_functions_and_resolves_submodules():
    known = {"kvfast.bugs", "kvfast.bugs.score", "kvfast.studies", "kvfast.studies.detector", "kvfast.model"}
    source = (
        "from kvfast.bugs import score\n"
        "def f():\n"
        "    from kvfast.studies.detector import DetectorCase\n"
        "    import kvfast.model.config\n"
    )
    found = imported_modules(source, "kvfast.sweep.inline", False, known)
    assert found == {"kvfast.bugs", "kvfast.bugs.score", "kvfast.studies", "kvfast.studies.detector", "kvfast.model"}


def test_the_checks_fail_on_a_right_to_left_edge_and_on_a_cycle(graph):
    """The checks can fail: one fake edge from the catalogue to studies, and one from the product to the
    catalogue (the circles this test guards against: a bug that is a branch inside the adapter)."""
    fake = {name: set(targets) for name, targets in graph.items()}
    fake["kvfast.bugs.score"].add("kvfast.studies.detector")
    assert right_to_left(fake) == ["kvfast.bugs.score (bugs) imports kvfast.studies.detector (studies)"]
    found = cycles(fake)
    assert len(found) == 1 and {"kvfast.bugs.score", "kvfast.studies.detector"} <= set(found[0])
    fake = {name: set(targets) for name, targets in graph.items()}
    fake["kvfast.check.hf_path"].add("kvfast.bugs.operations")
    assert right_to_left(fake) == ["kvfast.check.hf_path (check) imports kvfast.bugs.operations (bugs)"]
    assert any({"kvfast.check.hf_path", "kvfast.bugs.operations"} <= set(group) for group in cycles(fake))
    with pytest.raises(ValueError, match="in no layer"):
        layer_of("kvfast.newthing")


def test_the_checker_never_imports_the_bug_catalogues(graph):
    """The product holds no test tooling: no module of ``kvfast.check`` imports ``kvfast.bugs`` (the layers say
    it too; this names the rule), and the catalogues do import the checker (their bugs subclass its adapters)."""
    product = {name: targets for name, targets in graph.items() if name.startswith("kvfast.check")}
    assert {t for targets in product.values() for t in targets if t.startswith("kvfast.bugs")} == set()
    assert {t for targets in product.values() for t in targets if t.startswith("kvfast.repro")} == set()
    assert "kvfast.check.hf" in graph["kvfast.bugs.hf"] and "kvfast.check.adapters" in graph["kvfast.bugs.operations"]


def test_the_runtime_leaf_imports_only_validation(graph):
    """``kvfast.runtime`` is run by check, sweep and the commands alike: it imports nothing of theirs."""
    for name, targets in graph.items():
        if name == "kvfast.runtime" or name.startswith("kvfast.runtime."):
            outside = {t for t in targets if not t.startswith("kvfast.runtime")}
            assert outside <= {"kvfast.validation", "kvfast._lazy"}, name


def test_the_sweep_imports_nothing_from_the_studies(graph):
    """Issue 29: ``Study`` is the sweep's contract (:mod:`kvfast.sweep.study`); studies register into its registry
    and sit above it. The rule, named, and shown to fail on the edge it used to have (``grid`` looked names up in
    ``kvfast.studies.STUDIES``)."""
    sweep = {name: targets for name, targets in graph.items() if name.startswith("kvfast.sweep")}
    assert {t for targets in sweep.values() for t in targets if t.startswith("kvfast.studies")} == set()
    assert "kvfast.sweep.study" in graph["kvfast.studies"]  # the built-in studies register into the sweep's registry
    fake = {name: set(targets) for name, targets in graph.items()}
    fake["kvfast.sweep.grid"].add("kvfast.studies")
    assert right_to_left(fake) == ["kvfast.sweep.grid (sweep) imports kvfast.studies (studies)"]
    assert any({"kvfast.sweep.grid", "kvfast.studies"} <= set(group) for group in cycles(fake))


#: What the engine adapters (``kvfast.check.engines``) never reach, directly or through another module: the judge,
#: the scenarios, the options, and the pipeline that holds them. An adapter receives a plain record of what a check
#: will do (:class:`kvfast.check.protocol.CheckPlan`) and sits at the ground of ``kvfast.check``.
ABOVE_THE_ENGINES = (
    "kvfast.check.judge",
    "kvfast.check.scenarios",
    "kvfast.check.options",
    "kvfast.check.checker",
    "kvfast.check.reference",
)


def reached(graph: dict[str, set[str]], name: str) -> set[str]:
    """Every kvfast module importing ``name`` runs, directly or through another."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def engines_above(graph: dict[str, set[str]]) -> list[str]:
    """Each engine adapter module that reaches a module of :data:`ABOVE_THE_ENGINES`, as readable lines."""
    bad = []
    for name in sorted(graph):
        if name == "kvfast.check.engines" or name.startswith("kvfast.check.engines."):
            for target in sorted(reached(graph, name)):
                if any(target == p or target.startswith(p + ".") for p in ABOVE_THE_ENGINES):
                    bad.append(f"{name} reaches {target}")
    return bad


def test_the_engine_adapters_import_nothing_from_the_judge_the_scenarios_or_the_options(graph):
    """Issue 41: the vLLM adapter called ``judge_for`` itself; now every adapter reads the plan it is given. The
    rule, and two controls: a direct fake edge, and one through a module an adapter reaches (``formats``)."""
    assert engines_above(graph) == []
    assert "kvfast.check.formats" in reached(graph, "kvfast.check.engines.vllm")  # the walk follows the edges
    fake = {name: set(targets) for name, targets in graph.items()}
    fake["kvfast.check.engines.vllm"].add("kvfast.check.judge")
    assert "kvfast.check.engines.vllm reaches kvfast.check.judge" in engines_above(fake)
    fake = {name: set(targets) for name, targets in graph.items()}
    fake["kvfast.check.formats"].add("kvfast.check.scenarios.decode")
    assert "kvfast.check.engines.vllm reaches kvfast.check.scenarios.decode" in engines_above(fake)
