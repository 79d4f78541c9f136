"""``kvfast bench kernels``: kernel speed against BLAS, decode vs forward, compile cost."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks (kernels)",
        description="Time kvfast's own kernels on this machine: GFLOP/s against BLAS, a decode step against a full "
        "forward, cold compile against warm start. Prints Markdown tables.",
    )
    p.add_argument("what", choices=["kernels"], help="what to benchmark")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per figure (the median is quoted)")
    p.set_defaults(func=run)


def run(args) -> int:
    from kvfast.kernel_bench import main

    return main(repeats=args.repeats)
