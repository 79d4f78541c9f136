"""Where a cold start's compile time goes: CPU seconds per compiled kernel specialisation.

    python benchmarks/compile_profile.py [--preset f64] [--all]

Points Numba's cache at an empty temporary directory, then imports kvfast and runs the same
``generate`` as the cold start of ``kvfast bench kernels`` in this process, recording every
compilation with Numba's event API (``numba:compile``). Prints the total CPU time, then one line per
kernel called from Python (its time includes the kernels it compiles on the way), and with
``--all`` every nested compilation too, deepest indented; a kernel listed twice with different
argument types (e.g. ``Literal[int](0)`` against ``int64``) was compiled twice.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="f64", choices=["f64", "f32", "bf16"])
    parser.add_argument("--all", action="store_true", help="also list nested compilations")
    args = parser.parse_args()
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvfast-numba-")
    c0 = time.process_time()
    from numba.core import event

    records: list[tuple[float, int, str, str]] = []
    started: list[float] = []

    class Listener(event.Listener):
        def on_start(self, ev):
            started.append(time.process_time())

        def on_end(self, ev):
            seconds = time.process_time() - started.pop()
            name = ev.data["dispatcher"].py_func.__name__
            types = str(ev.data["args"]).replace("Array(float64, 2, 'C', False, aligned=True)", "f64[:, :]")
            records.append(
                (seconds, len(started), name, types.replace("Array(float64, 1, 'C', False, aligned=True)", "f64[:]"))
            )

    event.register("numba:compile", Listener())
    import kvfast

    cfg = kvfast.ModelConfig(vocab=64, d_model=32, n_head=4, n_layer=2, d_ff=64, max_pos=32)
    params = kvfast.init_params(cfg, 0)
    kvfast.generate(cfg, params, [1, 2, 3], 4, kvfast.Numerics.preset(args.preset))
    total = time.process_time() - c0
    print(f"cold start (import kvfast, one generate, preset {args.preset}): {total:.2f} s CPU")
    for seconds, depth, name, types in records:
        if depth == 0 or args.all:
            print(f"{seconds:7.2f}  {'  ' * depth}{name} {types[:150]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
