"""The tables documents copy from one source, generated from it.

Each table is made from what the code or the project's metadata holds:

- ``check-exit-codes``: ``kvfast.commands.check.EXIT_CODES``;
- ``check-options``: the fields of ``kvfast.check.options.CheckOptions`` (default, flag and its help;
  a field without a flag: :data:`PYTHON_ONLY`);
- ``sweep-exit-codes``: ``kvfast.commands.sweep.EXIT_CODES``;
- ``extras``: the optional dependencies of ``pyproject.toml`` (what each is for: :data:`EXTRA_USES`);
- ``dev-commands``: ``dev.py``'s :data:`COMMANDS` (the environment and extras each command installs).

A document holds a copy between two markers (:func:`begin`, :func:`end`), placed where :data:`PLACES` says.
``python tests/doctables.py`` rewrites every copy from its source; ``tests/docs/test_doc_tables.py`` fails when a
copy differs from what this module generates (or a marker is missing).
"""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: what each optional extra of pyproject.toml is for (a new extra without a line here fails the test)
EXTRA_USES = {
    "hf": "Hugging Face causal LMs (`kvfast.check.hf`, `kvfast scan`); install torch's CPU build first for CPU only",
    "plot": "the plots of `kvfast report` and `kvfast reproduce` (without it the report has tables only)",
    "dask": "`kvfast run --backend dask`: a local Dask cluster or your own (`--scheduler`)",
    "quanto": "transformers' quanto `QuantizedCache` (lossy caches, docs/check.md section 11)",
    "ort": "onnxruntime-genai models (`kvfast check --engine ort`); building its tiny test model also needs `hf`",
    "llamacpp": "llama.cpp models through llama-cpp-python (`--engine llamacpp`; a source build of about 40 minutes)",
    "vllm": 'vLLM\'s CPU build (`--engine vllm`), in an environment of its own (docs/engines.md, "vLLM")',
    "transformer_lens": "TransformerLens's `HookedTransformer` (`--engine transformer_lens`); 4.x bridges: install "
    'TransformerLens directly (docs/engines.md, "TransformerLens")',
    "test": "the test suite's own needs (pytest, pytest-xdist, hypothesis, scikit-learn, ruff, Dask, DuckDB, "
    "CTranslate2, ...)",
}


#: what each CheckOptions field without a flag does (a new flagless field without a line here fails the test)
PYTHON_ONLY = {"keep_logits": "Python only: keep each scenario's cache logits and reference rows in its report"}


def check_options() -> str:
    """One row per ``CheckOptions`` field, in its order: the field, its default, its flag and what it does (the
    flag's help: the one text ``kvfast check --help`` prints)."""
    from dataclasses import fields

    from kvfast.check.options import CheckOptions

    rows = []
    for f in fields(CheckOptions):
        flag = f.metadata.get("flag")
        if flag is None and f.name not in PYTHON_ONLY:
            raise ValueError(f"PYTHON_ONLY (tests/doctables.py): describe the field {f.name!r}, which has no flag")
        default = ", ".join(f.default) if isinstance(f.default, tuple) else f.default
        if flag is None:
            cli, what = "-", PYTHON_ONLY[f.name]
        else:
            choices = None if flag.choices is None else "{" + ",".join(flag.choices) + "}"
            value = "" if flag.bare is not None and choices is None else f" {flag.metavar or choices}"
            cli, what = f"`{flag.name}{value}`", flag.help
        rows.append(f"| `{f.name}` | `{default}` | {cli} | {what} |")
    return "\n".join(["| option | default | flag | what it does |", "|---|---|---|---|", *rows])


def _exit_code_table(header: str, codes: dict[int, str]) -> str:
    rows = [f"| {code} | {text} |" for code, text in codes.items()]
    return "\n".join([f"| exit code | {header} |", "|---|---|", *rows])


def check_exit_codes() -> str:
    from kvfast.commands.check import EXIT_CODES

    return _exit_code_table("`kvfast check`", EXIT_CODES)


def sweep_exit_codes() -> str:
    from kvfast.commands.sweep import EXIT_CODES

    return _exit_code_table("`kvfast run`, `kvfast study`, `kvfast reproduce`", EXIT_CODES)


def extras(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """One row per extra, in pyproject.toml's order: its name, what it is for, the packages it installs."""
    optional = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    missing = sorted(set(optional) - set(EXTRA_USES))
    stale = sorted(set(EXTRA_USES) - set(optional))
    if missing or stale:
        raise ValueError(f"EXTRA_USES (tests/doctables.py): describe {missing}, drop {stale}")
    rows = [
        f"| `{name}` | {EXTRA_USES[name]} | {', '.join(f'`{req}`' for req in requirements)} |"
        for name, requirements in optional.items()
    ]
    return "\n".join(["| extra | for | installs |", "|---|---|---|", *rows])


def _dev() -> object:
    spec = importlib.util.spec_from_file_location("kvfast_dev_script", ROOT / "dev.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dev_commands() -> str:
    """One row per ``python3 dev.py`` command: what it runs, its environment and what it installs there."""
    dev = _dev()
    versions = {
        "newest": "the newest releases pyproject.toml allows",
        "lowest": "every dependency at its lower bound (`.ci/lowest.txt`)",
        "vllm": f"`{dev.TORCH_CPU}`, `{dev.VLLM}`, then kvfast and its own dependencies",
        "tl": f"`{dev.TORCH_CPU}`, `{dev.TL}`, `{dev.TL_TRANSFORMERS}`, then kvfast",
    }
    rows = []
    for name, (what, venv, extras, chosen) in dev.COMMANDS.items():
        torch = f"`{dev.TORCH_CPU}`, " if "hf" in extras.split(",") else ""
        installs = f"{torch}`kvfast[{extras}]` (editable): {versions[chosen]}" if extras else versions[chosen]
        rows.append(f"| `python3 dev.py {name}` | {what} | `{venv}` | {installs} |")
    return "\n".join(["| command | runs | environment | installs |", "|---|---|---|---|", *rows])


#: table name -> (its source in words, the function that generates it)
TABLES: dict[str, tuple[str, Callable[[], str]]] = {
    "check-exit-codes": ("kvfast.commands.check.EXIT_CODES", check_exit_codes),
    "check-options": ("kvfast.check.options.CheckOptions", check_options),
    "sweep-exit-codes": ("kvfast.commands.sweep.EXIT_CODES", sweep_exit_codes),
    "extras": ("pyproject.toml's optional-dependencies", extras),
    "dev-commands": ("dev.py's COMMANDS", dev_commands),
}

#: document (relative to the repository) -> the tables it holds a copy of
PLACES: dict[str, tuple[str, ...]] = {
    "README.md": ("extras",),
    "docs/check.md": ("check-options", "check-exit-codes"),
    "docs/sweep.md": ("sweep-exit-codes",),
    "docs/development.md": ("dev-commands", "extras"),
}


def begin(name: str) -> str:
    return f"<!-- table {name}: generated from {TABLES[name][0]} by `python tests/doctables.py`; do not edit -->"


def end(name: str) -> str:
    return f"<!-- end of table {name} -->"


def copies(text: str) -> dict[str, str]:
    """Every table copy in a document's text, by name (``ValueError`` for a begin marker without its end)."""
    found = {}
    for match in re.finditer(r"<!-- table ([a-z-]+): generated from ", text):
        name = match.group(1)
        start = text.index("-->", match.end()) + 3
        stop = text.find(end(name), start)
        if stop < 0:
            raise ValueError(f"table {name}: its end marker is missing")
        found[name] = text[start:stop].strip()
    return found


def stale(text: str, names: tuple[str, ...]) -> list[str]:
    """What is wrong with a document's copies of the tables ``names``: one line each (empty when every copy
    equals its source's table)."""
    problems = []
    try:
        found = copies(text)
    except ValueError as exc:
        return [str(exc)]
    for name in names:
        if name not in found or begin(name) not in text:
            problems.append(f"table {name}: no copy between its markers")
        elif found[name] != TABLES[name][1]():
            problems.append(f"table {name}: differs from {TABLES[name][0]}")
    problems += [f"table {name}: a copy where PLACES puts none" for name in found if name not in names]
    return problems


def rewrite(text: str, names: tuple[str, ...]) -> str:
    """``text`` with each copy of ``names`` replaced by the table generated now."""
    for name in names:
        head, tail = begin(name), end(name)
        if head not in text or tail not in text:
            raise ValueError(f"table {name}: its markers are missing; add {head} and {tail}")
        before, rest = text.split(head, 1)
        _, after = rest.split(tail, 1)
        text = f"{before}{head}\n{TABLES[name][1]()}\n{tail}{after}"
    return text


def main() -> int:
    for doc, names in PLACES.items():
        path = ROOT / doc
        text = path.read_text()
        new = rewrite(text, names)
        if new != text:
            path.write_text(new)
            print(f"rewrote {doc}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
