"""Where the unrolled product bodies start to beat the plain ones: the threshold of the product size class.

    PYTHONPATH=$PWD python benchmarks/kernels_size_class.py [--repeats 7] [--quick]

The f64 and f32 product bodies come in two forms with the same order and the same bits
(:mod:`kvfast.kernels.matmul`): *unrolled* (``_product_template``: four rows per pass over ``w``, four k
per pass over a row) and *plain* (``_product_plain_template``: one row, one k per pass). Which one a
product runs is its *size class* (:func:`kvfast.kernels.matmul.size_class`), chosen in Python from the
product's shape; the unrolled bodies cost several times the plain ones' cold compile, so a process
compiles them only when it runs a large product.

For each body (f64; f32 on float32 lanes; f32 on float64 data) and each shape ``(T, n, m)`` (``x``:
(T, n), ``w``: (n, m)), both orders: the time of one product by the plain body and by the unrolled one,
called directly (the same dispatch cost for both), interleaved, median of ``--repeats`` samples each
(a sample: the mean of enough calls to last about 20 ms); printed as microseconds and the ratio
plain / unrolled (> 1: the unrolled body is faster), with ``n * m`` (the size class's measure) and the
class :func:`size_class` gives. Then the cold compile of each body (CPU s, an empty Numba cache, one
fresh process per body). The load average is printed: the machine may be shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

SHAPES = [(1, 16, 16), (8, 16, 32), (1, 32, 64), (3, 32, 64), (16, 32, 64), (26, 32, 64), (32, 64, 256),
          (1, 64, 64), (1, 128, 128),
          (4, 64, 64), (16, 64, 64), (64, 64, 64), (16, 128, 128), (64, 128, 128), (1, 256, 256),
          (16, 256, 256), (256, 256, 256)]  # fmt: skip
QUICK = [(1, 16, 16), (16, 32, 64), (32, 64, 256), (1, 128, 128), (64, 128, 128), (256, 256, 256)]
BODIES = [("f64", "_product_f64", "_product_plain_f64", np.float64),
          ("f32 on float32", "_product_f32_on_f32", "_product_plain_f32_on_f32", np.float32),
          ("f32 on float64", "_product_f32", "_product_plain_f32", np.float64)]  # fmt: skip

COMPILE = r"""
import sys, time, numpy as np
from kvfast.kernels import matmul
name, dt = sys.argv[1], np.dtype(sys.argv[2])
x, w, y = np.ones((4, 8), dt), np.ones((8, 8), dt), np.empty((4, 8), dt)
body = getattr(matmul, name)
body(x, w, 0, y)  # warm Numba itself up: compile a first body of another form is not timed here
"""


def _sample(body, x, w, order, y, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        body(x, w, order, y)
    return (time.perf_counter() - t) / calls


def _calls(body, x, w, order, y) -> int:
    calls = 1
    while _sample(body, x, w, order, y, calls) * calls < 0.02:
        calls *= 2
    return calls


def speed(shapes, repeats: int) -> None:
    from kvfast.kernels import matmul

    rng = np.random.default_rng(0)
    print(f"{'body':<15} {'order':<10} {'T':>4} {'n':>4} {'m':>4} {'n*m':>6} {'class':<8} "
          f"{'plain us':>9} {'unrolled us':>11} {'plain/unrolled':>14}")  # fmt: skip
    for label, unrolled_name, plain_name, dt in BODIES:
        unrolled, plain = getattr(matmul, unrolled_name), getattr(matmul, plain_name)
        for order, order_name in ((0, "sequential"), (1, "pairwise")):
            for T, n, m in shapes:
                x = rng.standard_normal((T, n)).astype(np.float32).astype(dt)
                w = rng.standard_normal((n, m)).astype(np.float32).astype(dt)
                y1, y2 = np.empty((T, m), dt), np.empty((T, m), dt)
                plain(x, w, order, y1)
                unrolled(x, w, order, y2)
                assert y1.tobytes() == y2.tobytes(), (label, order, T, n, m)  # the same bits
                calls = _calls(plain, x, w, order, y1)
                p, u = [], []
                for _ in range(repeats):
                    p.append(_sample(plain, x, w, order, y1, calls))
                    u.append(_sample(unrolled, x, w, order, y2, calls))
                mp, mu = statistics.median(p) * 1e6, statistics.median(u) * 1e6
                cls = "large" if matmul.size_class(T, n, m) else "small"
                print(f"{label:<15} {order_name:<10} {T:>4} {n:>4} {m:>4} {n * m:>6} {cls:<8} {mp:>9.2f} {mu:>11.2f} "
                      f"{mp / mu:>14.2f}")  # fmt: skip
    print(f"load average (1, 5 min): {os.getloadavg()[0]:.2f}, {os.getloadavg()[1]:.2f}")


def compile_times() -> None:
    """Cold compile of each body in a fresh process (CPU s of the compile alone, after Numba's own warm-up:
    the first body compiled in a process also pays for Numba's start)."""
    print("cold compile of one body (CPU s, fresh process, empty cache, after a warm-up compile of another body):")
    script = COMPILE + (
        "other = matmul._product_bf16\n"
        "t = time.process_time()\n"
        "getattr(matmul, sys.argv[3])(x, w, 0, y)\n"
        "print(time.process_time() - t)\n"
    )
    for label, unrolled_name, plain_name, dt in BODIES:
        row = []
        for name in (plain_name, unrolled_name):
            env = {**os.environ, "NUMBA_CACHE_DIR": tempfile.mkdtemp(prefix="kvfast-size-class-")}
            warm = "_product_bf16_on_f32" if dt is np.float32 else "_product_bf16"
            out = subprocess.run(
                [sys.executable, "-c", script.replace("body = getattr(matmul, name)", f"body = matmul.{warm}"), warm,
                 np.dtype(dt).name, name], env=env, check=True, capture_output=True, text=True,
            )  # fmt: skip
            row.append(float(out.stdout.split()[-1]))
        print(f"  {label:<15} plain {row[0]:.2f}  unrolled {row[1]:.2f}")
    print(f"load average (1, 5 min): {os.getloadavg()[0]:.2f}, {os.getloadavg()[1]:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--no-compile", action="store_true", help="skip the cold compile times")
    args = parser.parse_args()
    speed(QUICK if args.quick else SHAPES, args.repeats)
    if not args.no_compile:
        compile_times()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
