"""The matmul kernels against a previous version of themselves, bit for bit, on a large random sample.

    python benchmarks/matmul_vs_previous.py [--commit add1f29] [--cases 100000] [--seed 0]

Loads ``kvfast/kernels/matmul.py`` as it was at ``--commit`` (``git show``, so run it inside the
repository) next to the current one and compares ``matmul(x, w, storage, acc, order)`` of both on
random cases: every storage, accumulator and order; T in 0..17 and n, m in 0..67 (odd sizes, so
every row and column remainder of the kernels is met); values of three kinds: normal numbers
scaled by powers of two from the subnormal range to overflow, with signed zeros, infinities and
NaNs; values with short significands (products and sums often land exactly on bfloat16 and float32
midpoints, so ties are decided); and values near the bfloat16 overflow and subnormal thresholds.
Inputs are rounded to the storage format (so storage = accumulator exercises the float32-lane
paths) or, for a quarter of the cases, left in float64 (the float64-lane paths). Then a few large
shapes. Results are equal when their float64 bit patterns are, or both are NaN (which NaN operand's
sign an add keeps is the compiler's choice). Prints the counts and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvfast.kernels.matmul import matmul
from kvfast.kernels.precision import FORMAT_CODES, round_array
from kvfast.kernels.reduce import ORDER_CODES


def load_previous(commit: str):
    """The module ``kvfast/kernels/matmul.py`` at ``commit``, imported under another name."""
    source = subprocess.run(
        ["git", "show", f"{commit}:kvfast/kernels/matmul.py"], capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="kvfast-prev-")) / "previous_matmul.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("previous_matmul", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_values(rng: np.random.Generator, shape) -> np.ndarray:
    kind = rng.integers(0, 3)
    size = int(np.prod(shape))
    if kind == 0:  # wide exponents with specials
        v = rng.standard_normal(size) * np.exp2(rng.integers(-150, 130, size=size).astype(float))
        specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan])
        mask = rng.random(size) < 0.05
        v[mask] = rng.choice(specials, size=int(mask.sum()))
    elif kind == 1:  # short significands: many exact ties in the accumulator roundings
        v = rng.integers(-255, 256, size=size) * np.exp2(rng.integers(-12, 4, size=size).astype(float))
    else:  # near bfloat16's overflow and subnormal thresholds
        big = rng.integers(-255, 256, size=size) * np.exp2(rng.integers(56, 58, size=size).astype(float))
        tiny = rng.integers(-255, 256, size=size) * np.exp2(rng.integers(-80, -60, size=size).astype(float))
        v = np.where(rng.random(size) < 0.5, big, tiny)
    return v.reshape(shape)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    both_nan = np.isnan(a) & np.isnan(b)
    return a.shape == b.shape and bool(np.all((a.view(np.uint64) == b.view(np.uint64)) | both_nan))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commit", default="add1f29")
    parser.add_argument("--cases", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    previous = load_previous(args.commit)
    rng = np.random.default_rng(args.seed)
    formats = list(FORMAT_CODES.values())
    orders = list(ORDER_CODES.values())
    t0 = time.perf_counter()
    counts = {"cases": 0, "different": 0, "elements": 0}
    by_combo: dict[tuple[int, int, int], int] = {}
    for _ in range(args.cases):
        storage, acc, order = int(rng.choice(formats)), int(rng.choice(formats)), int(rng.choice(orders))
        T, n, m = int(rng.integers(0, 18)), int(rng.integers(0, 68)), int(rng.integers(0, 68))
        x, w = random_values(rng, (T, n)), random_values(rng, (n, m))
        if rng.random() < 0.75:
            x, w = round_array(x, storage), round_array(w, storage)
        got, want = matmul(x, w, storage, acc, order), previous.matmul(x, w, storage, acc, order)
        counts["cases"] += 1
        counts["elements"] += got.size
        by_combo[(storage, acc, order)] = by_combo.get((storage, acc, order), 0) + 1
        if not same(got, want):
            counts["different"] += 1
            print(f"DIFFERENT: storage {storage} acc {acc} order {order} shape ({T}, {n}) @ ({n}, {m})")
    for T, n, m in [(5, 77, 20000), (64, 256, 256), (256, 256, 256), (7, 1031, 129)]:
        for storage in formats:
            for acc in formats:
                for order in orders:
                    x = round_array(random_values(rng, (T, n)), storage)
                    w = round_array(random_values(rng, (n, m)), storage)
                    got, want = matmul(x, w, storage, acc, order), previous.matmul(x, w, storage, acc, order)
                    counts["cases"] += 1
                    counts["elements"] += got.size
                    if not same(got, want):
                        counts["different"] += 1
                        print(f"DIFFERENT (large): storage {storage} acc {acc} order {order} ({T}, {n}) @ ({n}, {m})")
    print(
        f"{counts['cases']} cases ({counts['elements']} output elements, {len(by_combo)} storage/accumulator/order"
        f" combinations, at least {min(by_combo.values())} random cases each) against commit {args.commit}:"
        f" {counts['different']} different; {time.perf_counter() - t0:.0f} s"
    )
    return 1 if counts["different"] else 0


if __name__ == "__main__":
    sys.exit(main())
