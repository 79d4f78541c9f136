"""A benchmark script runs with benchmarks/ first on ``sys.path``: no file there may share a name with a package the
benchmarks import, directly or through a dependency (``benchmarks/kernels.py`` shadowed the ``kernels`` package that
transformers imports, and every Hugging Face benchmark failed at its first model)."""

from __future__ import annotations

from pathlib import Path

from shared import ROOT

BENCHMARKS = ROOT / "benchmarks"
#: packages the benchmarks import, directly or through transformers (kernels), by these names
IMPORTED = {"kernels", "torch", "transformers", "numpy", "numba", "pandas", "vllm", "onnx", "onnxruntime", "kvfast"}


def shadowing(folder: Path) -> set[str]:
    """The names in ``folder`` (modules and packages) that would shadow one of :data:`IMPORTED`."""
    return ({p.stem for p in folder.glob("*.py")} | {p.name for p in folder.iterdir() if p.is_dir()}) & IMPORTED


def test_no_benchmark_file_shadows_a_package(tmp_path):
    assert shadowing(BENCHMARKS) == set()
    (tmp_path / "kernels.py").write_text("")  # the control: the file that shadowed transformers' kernels
    assert shadowing(tmp_path) == {"kernels"}
