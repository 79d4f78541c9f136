"""Benchmark: explicit-order kernels against BLAS, decode step against forward, cold against warm start.

    .venv/bin/python benchmarks/kernel_speed.py [--repeats 5]

The same as ``kvfast bench kernels``; see :mod:`kvfast.kernel_bench` for what
is timed and how. Prints Markdown tables (figures recorded in benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import sys

from kvfast.kernel_bench import main as bench_main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="samples per figure (the median is printed)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    return bench_main(repeats=args.repeats)


if __name__ == "__main__":
    sys.exit(main())
