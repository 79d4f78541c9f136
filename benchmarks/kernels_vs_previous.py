"""The kernels against a previous version of themselves, bit for bit, on a large random sample.

    python benchmarks/kernels_vs_previous.py [--commit add1f29] [--cases 100000] [--seed 0]

Loads ``kvfast/kernels/`` as it was at ``--commit`` (``git show``, so run it inside the repository)
as a package of its own, next to the current one. First ``matmul(x, w, storage, acc, order)`` of
both on random cases: every storage, accumulator and order; T in 0..17 and n, m in 0..67 (odd sizes, so
every row and column remainder of the kernels is met); values of three kinds: normal numbers
scaled by powers of two from the subnormal range to overflow, with signed zeros, infinities and
NaNs; values with short significands (products and sums often land exactly on bfloat16 and float32
midpoints, so ties are decided); and values near the bfloat16 overflow and subnormal thresholds.
Inputs are rounded to the storage format (so storage = accumulator exercises the float32-lane
paths) or, for a quarter of the cases, left in float64 (the float64-lane paths). Then a few large
shapes. Then ``attention_into`` and ``rmsnorm_into`` of both on ``--cases``/4 random cases: every storage,
accumulator, summation order and attention order (standard, online, split-KV, split by count), causal
or not, T in 1..12, head dims 1..16, inputs rounded to the storage format. Results are equal when
their float64 bit patterns are, or both are NaN (which NaN operand's sign an add keeps is the
compiler's choice). Prints the counts and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvfast.kernels.attention import ATTENTION_CODES, STANDARD, attention_into
from kvfast.kernels.matmul import matmul
from kvfast.kernels.precision import FORMAT_CODES, round_array
from kvfast.kernels.reduce import ORDER_CODES
from kvfast.kernels.rowops import rmsnorm_into

KERNEL_MODULES = ("precision", "reduce", "matmul", "attention", "rowops")


def load_previous(commit: str) -> dict:
    """``kvfast/kernels/{precision,reduce,matmul,attention,rowops}.py`` at ``commit``, as the package
    ``previous_kernels`` (their imports of each other rewritten to it), by module name."""
    root = Path(tempfile.mkdtemp(prefix="kvfast-prev-"))
    package = root / "previous_kernels"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in KERNEL_MODULES:
        source = subprocess.run(
            ["git", "show", f"{commit}:kvfast/kernels/{name}.py"], capture_output=True, text=True, check=True
        ).stdout
        for other in KERNEL_MODULES:
            source = source.replace(f"from kvfast.kernels.{other} import", f"from previous_kernels.{other} import")
        (package / f"{name}.py").write_text(source)
    sys.path.insert(0, str(root))
    return {name: importlib.import_module(f"previous_kernels.{name}") for name in KERNEL_MODULES}


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
    previous_kernels = load_previous(args.commit)
    previous = previous_kernels["matmul"]
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
        f"matmul: {counts['cases']} cases ({counts['elements']} output elements, {len(by_combo)}"
        f" storage/accumulator/order combinations, at least {min(by_combo.values())} random cases each)"
        f" against commit {args.commit}:"
        f" {counts['different']} different; {time.perf_counter() - t0:.0f} s"
    )
    different = counts["different"] + compare_attention_and_rmsnorm(previous_kernels, rng, args.cases // 4, args.commit)
    return 1 if different else 0


def compare_attention_and_rmsnorm(previous: dict, rng: np.random.Generator, cases: int, commit: str) -> int:
    """attention_into and rmsnorm_into against the previous kernels; prints a line, returns the
    number of cases that differ."""
    t0 = time.perf_counter()
    formats = list(FORMAT_CODES.values())
    orders = list(ORDER_CODES.values())
    modes = list(ATTENTION_CODES.values())
    different = 0
    elements = 0
    for _ in range(cases):
        storage, acc, order = int(rng.choice(formats)), int(rng.choice(formats)), int(rng.choice(orders))
        mode, causal = int(rng.choice(modes)), bool(rng.integers(0, 2))
        n_head, hd, T = int(rng.integers(1, 4)), int(rng.integers(1, 17)), int(rng.integers(1, 13))
        d = n_head * hd
        param = 0 if mode == STANDARD else int(rng.integers(1, 6))
        q, k, v = (
            round_array(rng.standard_normal((T, d)) * np.exp2(rng.integers(-3, 3, (T, d))), storage) for _ in "qkv"
        )
        args = (q, k, v, 0, T, causal, n_head, 1.0 / np.sqrt(hd), storage, acc, order)
        got, want = np.empty((T, d)), np.empty((T, d))
        attention_into(*args, got, np.empty((0, 0, 0)), mode, param)
        previous["attention"].attention_into(*args, want, np.empty((0, 0, 0)), mode, param)
        g = round_array(1.0 + 0.1 * rng.standard_normal(d), storage)
        rms_got, rms_want, inv_got, inv_want = np.empty((T, d)), np.empty((T, d)), np.empty(T), np.empty(T)
        rmsnorm_into(q, g, 1e-5, storage, acc, order, rms_got, inv_got)
        previous["rowops"].rmsnorm_into(q, g, 1e-5, storage, acc, order, rms_want, inv_want)
        elements += got.size + rms_got.size
        if not (same(got, want) and same(rms_got, rms_want) and same(inv_got, inv_want)):
            different += 1
            print(f"DIFFERENT: attention/rmsnorm storage {storage} acc {acc} order {order} mode {mode} T {T} d {d}")
    print(
        f"attention_into and rmsnorm_into: {cases} cases ({elements} output elements) against commit {commit}:"
        f" {different} different; {time.perf_counter() - t0:.0f} s"
    )
    return different


if __name__ == "__main__":
    sys.exit(main())
