"""The baselines of ``kvfast bench kernels`` compute what the benchmark says they do."""

from __future__ import annotations

import numpy as np
import pytest

from kvfast.kernel_bench import growth_exponent, main, numpy_bf16_matmul
from kvfast.kernels.matmul import matmul
from kvfast.kernels.precision import BF16, round_array
from kvfast.kernels.reduce import PAIRWISE, SEQUENTIAL


def test_numpy_bf16_loop_equals_the_bf16_kernel_bit_for_bit():
    """The NumPy + ml_dtypes loop is the bf16-accumulator sequential product (inputs on the bf16
    grid), so the speed ratio compares the same computation; the pairwise kernel differs."""
    rng = np.random.default_rng(0)
    differs = 0
    for T, n, m in [(1, 1, 1), (5, 37, 9), (16, 64, 64), (3, 300, 17)]:
        x = round_array(rng.standard_normal((T, n)) * np.exp2(rng.integers(-20, 20, (T, n))), BF16)
        w = round_array(rng.standard_normal((n, m)) * np.exp2(rng.integers(-20, 20, (n, m))), BF16)
        with np.errstate(over="ignore", invalid="ignore"):
            loop = numpy_bf16_matmul(x, w)
        assert np.array_equal(loop.view(np.uint64), matmul(x, w, BF16, BF16, SEQUENTIAL).view(np.uint64))
        differs += not np.array_equal(loop.view(np.uint64), matmul(x, w, BF16, BF16, PAIRWISE).view(np.uint64))
    assert differs > 0


def test_growth_exponent_recovers_a_power_law():
    sizes = [128, 256, 512, 1024]
    assert growth_exponent(sizes, [3e-6 * s**1.5 for s in sizes]) == pytest.approx(1.5, abs=1e-9)
    assert growth_exponent(sizes, [0.1 * s for s in sizes]) == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize(("kwargs", "field"), [({"repeats": 0}, "repeats"), ({"sections": ["gpu"]}, "sections")])
def test_bad_arguments_are_refused_before_any_work(kwargs, field, capsys):
    with pytest.raises(ValueError, match=f"^{field}: .* is not allowed; allowed: "):
        main(**kwargs)
    assert capsys.readouterr().out == ""
