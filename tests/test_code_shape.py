"""The shape of the code: no function longer than a screen outside the kernels.

Kernels are loops whose length is their arithmetic (and Numba wants them whole); everywhere else a
function over :data:`MAX_LINES` lines does several jobs and is split by job (issue 17).
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvfast

ROOT = Path(kvfast.__file__).resolve().parent
MAX_LINES = 80


def long_functions(root: Path, max_lines: int = MAX_LINES) -> list[str]:
    """``path:line name (N lines)`` for every function (methods and nested ones included) over
    ``max_lines`` lines, decorators excluded, in the ``.py`` files under ``root`` outside ``kernels/``."""
    out = []
    for path in sorted(root.rglob("*.py")):
        if "kernels" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > max_lines:
                    out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_no_function_over_80_lines_outside_the_kernels():
    assert long_functions(ROOT) == []


def test_the_length_check_can_fail(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "long.py").write_text(f"def too_long():\n{body}\n")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "loop.py").write_text(f"def kernel():\n{body}\n")  # kernels are exempt
    (tmp_path / "short.py").write_text("def fine():\n    return 1\n")
    assert long_functions(tmp_path) == [f"long.py:1 too_long ({MAX_LINES + 1} lines)"]
