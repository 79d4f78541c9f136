"""The PyTorch example (examples/torch_model.py) checked by kvfast; skipped where torch is not installed.

Install the CPU build to run these: ``.venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu``
(``python3 dev.py test`` and CI install it, and CI sets ``KVFAST_REQUIRE_HF=1`` so these cannot skip).
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
from shared import ROOT

if os.environ.get("KVFAST_REQUIRE_HF") == "1":  # CI (.ci/run): run these, never skip them
    import torch
else:
    torch = pytest.importorskip("torch")

import kvfast  # noqa: E402
from kvfast.check import KvfastModel, check_cache  # noqa: E402
from kvfast.check.protocol import to_numpy  # noqa: E402

EXAMPLE = ROOT / "examples" / "torch_model.py"
CFG = kvfast.ModelConfig(vocab=32, d_model=16, n_head=2, n_layer=2, d_ff=32, max_pos=32)
PROMPT = [3, 1, 4, 1]
STEPS = 8


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("kvfast_torch_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.set_num_threads(1)
    return module


@pytest.fixture(scope="module")
def npz(tmp_path_factory):
    path = tmp_path_factory.mktemp("torch") / "model.npz"
    kvfast.save_params(path, CFG, kvfast.init_params(CFG, 0))
    return path


def _model(example, npz, **kwargs):
    return example.TorchCacheModel(example.TorchDecoder.from_npz(npz, **kwargs))


def test_torch_decoder_computes_kvfasts_function(example, npz):
    _, params = kvfast.load_params(npz)
    ours = KvfastModel(CFG, params).recompute(np.array(PROMPT))
    theirs = to_numpy(_model(example, npz).recompute(PROMPT))
    assert np.abs(ours - theirs).max() <= 1e-12 * np.abs(ours).max()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_torch_example_exact_and_control(example, npz, dtype):
    rows = check_cache(_model(example, npz, dtype=dtype, batching="rows"), PROMPT, STEPS)
    assert rows.verdict == "exact"  # the batched forward one row at a time is the decode's arithmetic
    matrix = _model(example, npz, dtype=dtype)
    control = check_cache(matrix, PROMPT, STEPS, mode="control")
    assert control.verdict == "rounding"
    exact = check_cache(matrix, PROMPT, STEPS)
    # whatever the exact check says about whole-matrix vs one-row products, it is only rounding
    assert exact.max_deviation < (1e-12 if dtype == "float64" else 1e-4)


def test_torch_example_resume_bug(example, npz):
    bugged = check_cache(_model(example, npz, batching="rows", bug="posfrozen"), PROMPT, STEPS)
    assert bugged.scenarios["decode"].first_divergent_step == 2
    assert bugged.scenarios["resume"].first_divergent_step == 1
    control = check_cache(_model(example, npz, dtype="float32", bug="posfrozen"), PROMPT, STEPS, mode="control")
    assert control.verdict == "bug"


def test_torch_tensors_are_read_exactly():
    t = torch.tensor([1.0, 2.5, -3.015625], dtype=torch.bfloat16, requires_grad=True)
    assert to_numpy(t * 1).tolist() == [1.0, 2.5, -3.015625]
    assert to_numpy(torch.tensor([0.1], dtype=torch.float64)).tolist() == [0.1]


@pytest.mark.subprocess
def test_cli_on_the_torch_example(npz, monkeypatch, capsys):
    from kvfast.cli import main

    monkeypatch.chdir(EXAMPLE.parents[1])
    monkeypatch.setenv("KVFAST_NPZ", str(npz))
    args = ["check", "examples.torch_model:from_env", "--prompt", "1,2,3", "--steps", "4"]
    assert main([*args, "--mode", "control"]) == 0  # float32 whole-matrix vs one-row products: rounding
    assert "ROUNDING" in capsys.readouterr().out
    monkeypatch.setenv("KVFAST_DTYPE", "float16")
    assert main(args) == 2
    assert "dtype: 'float16' is not allowed" in capsys.readouterr().err
