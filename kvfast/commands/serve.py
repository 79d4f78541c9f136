"""``kvfast serve [--idle SECONDS] [--socket PATH]``: keep ``kvfast check``'s child warm (opt-in).

Runs in the foreground (``kvfast serve &``, another terminal, or a pytest fixture) and prints one line with
its socket's path. It does the work of a check's fresh child once: imports NumPy, Numba and the checker,
sets up Numba's CPU target and loads kvfast's own model's kernels (a tiny check of kvfast's model in each
preset, f64, f32 and bf16); then each ``kvfast check`` of the same interpreter, ``sys.path``, environment
and kvfast sources (the key: :mod:`kvfast.runtime.serve`) gets a child forked from it, its imports done,
instead of a fresh ``python -c``. Reports and exit codes are the same; with ``KVFAST_TIMELINE=FILE`` the
check's timeline says which (``parent: child forked by kvfast serve``, or ``parent: no kvfast serve (...)``
and ``parent: child spawned``). A check whose key differs (another virtual environment, an extra
environment variable, an edited kvfast source) does not find it and starts its own child, as without a
server; so does every check with ``KVFAST_SERVE=0``.

It exits after ``--idle`` seconds (default 600) without a check (never while a check runs), on SIGTERM,
Ctrl-C or SIGHUP (its terminal closed), removing its socket, with a line saying why (exit status 0). Its
warm-up takes seconds with a warm Numba cache (a cold one compiles the kernels first); its line is printed
when it is ready. The socket: ``$XDG_RUNTIME_DIR/kvfast/KEY.sock`` (else
``~/.cache/kvfast/serve/KEY.sock``; the directory made 0700), or ``--socket PATH`` (then a check finds it
with ``KVFAST_SERVE_SOCKET=PATH``). A stale socket (its server killed with SIGKILL) is replaced; a live
server on the same path is bad input (exit 2), as are bad flags.
"""

from __future__ import annotations

import argparse
import os

DEFAULT_IDLE_S = 600.0
#: kvfast's model for the warm-up: the benchmark's and the tests' size (any size loads the same kernels)
WARM_MODEL = {"seed": 0, "n_layer": 1, "n_head": 2, "d_model": 16, "d_ff": 32, "vocab": 32}
WARM_PRESETS = ("f64", "f32", "bf16")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: a number of seconds > 0")
    return value


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="keep kvfast check's child process warm: checks start in a fraction of a second (opt-in)",
        description="Keep kvfast check's child warm: fork each check's child from a process that has imported "
        "NumPy, Numba and the checker and loaded kvfast's kernels. Runs in the foreground; prints its socket's "
        "path; exits after --idle seconds without a check, on SIGTERM or Ctrl-C.",
    )
    p.add_argument(
        "--idle", type=_seconds, default=DEFAULT_IDLE_S, metavar="SECONDS",
        help=f"exit after this many seconds without a check (default {DEFAULT_IDLE_S:g})",
    )  # fmt: skip
    p.add_argument(
        "--socket", default=None, metavar="PATH",
        help="listen on PATH instead of the per-user default (checks find it with KVFAST_SERVE_SOCKET=PATH)",
    )  # fmt: skip
    p.set_defaults(func=run)


def warm_up() -> None:
    """A fresh check child's imports, Numba's CPU target and kvfast's model's kernels (a tiny check of each
    preset), and the check's parser with its option flags: what each forked child then has done."""
    import kvfast.check.checker  # noqa: F401
    from kvfast.bugs.kvfast_model import kvfast_model
    from kvfast.check.checker import check_cache_with
    from kvfast.check.options import CheckOptions
    from kvfast.cli import build_parser

    build_parser().parse_known_args(["check", "m:f", "--prompt", "1"])  # the option flags' module
    for preset in WARM_PRESETS:
        model = kvfast_model(**WARM_MODEL, preset=preset, order="sequential", attention="standard", bug="none")
        check_cache_with(model, [1, 2, 3, 4], CheckOptions.defaulting_steps(steps=2))


def run(args) -> int:
    from kvfast.commands.check import child
    from kvfast.runtime.serve import key, listen, serve

    own, env = key(), dict(os.environ)  # before the warm-up: the key a client computes before its imports
    listener, path = listen(own, args.socket)
    try:
        warm_up()
    except BaseException:
        listener.close()
        path.unlink()
        raise

    def announce(path) -> None:
        print(
            f"kvfast serve: listening on {path} (pid {os.getpid()}; exits after {args.idle:g} s without a check, "
            "on SIGTERM or Ctrl-C)",
            flush=True,
        )

    why = serve(child, own, env, listener, path, idle=args.idle, announce=announce)
    print(f"kvfast serve: stopped ({why}); {path} removed", flush=True)
    return 0
