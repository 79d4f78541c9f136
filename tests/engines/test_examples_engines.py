"""The worked engine examples under examples/ (CTranslate2), run where their package is installed (CI installs
ctranslate2 with the test extra: a wheel, ~14 s); skipped with the reason otherwise."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from shared import ROOT

pytest.importorskip("ctranslate2", reason="CTranslate2 is not installed (pip install ctranslate2)")
torch = pytest.importorskip("torch")

from kvfast.check import check_cache  # noqa: E402
from kvfast.testing import tiny_llama  # noqa: E402

EXAMPLE = ROOT / "examples" / "ctranslate2_model.py"


def _example():
    spec = importlib.util.spec_from_file_location("ctranslate2_model", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["ctranslate2_model"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("ct2")
    tiny_llama(out / "hf", seed=0)
    example = _example()
    return example, example.convert(out / "hf", out / "ct2"), out / "hf"


def test_ctranslate2_clean_is_rounding_and_an_eviction_is_a_bug_where_it_first_acts(converted):
    example, path, hf = converted
    report = check_cache(example.CT2Model(path, hf_model=hf), [3, 4, 5, 6, 7], 12, mode="control")
    assert report.verdict == "rounding", report.format()

    class Evicting(example.CT2Model):
        def decode(self, token):  # an injected bug: past 8 tokens the oldest is dropped before the step
            if len(self.prefix) >= 8:
                self.prefix = self.prefix[1:]
            return super().decode(token)

    found = check_cache(Evicting(path, hf_model=hf), [3, 4, 5, 6, 7], 12, mode="control", scenarios="decode")
    assert found.verdict == "bug"
    assert found.scenarios["decode"].first_bug_step == 4  # decode step 4 runs at length 8


def test_the_example_runs_as_a_script_and_refuses_a_bad_compute_type(converted):
    example, path, _ = converted
    with pytest.raises(ValueError, match="^compute_type: 'float64' is not allowed"):
        example.CT2Model(path, compute_type="float64")
    assert example.main() == 0
