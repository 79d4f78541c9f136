"""Calls through a kernel's address: its machine code is generated once, not again in every caller.

Numba links the code of every jitted function a jitted function calls into the caller's own module,
and optimises and emits it again there, at every level (``matmul``'s product bodies were emitted in
the body's own entry, in the format wrapper, in ``matmul_into``, in the compiled forward and in the
decode). A call through an address is a plain indirect call: the callee is compiled (or loaded from
Numba's cache) once, on its own, for one fixed signature, and a caller holds only the call.

- :func:`address`: a kernel's machine-code address for a signature (compiled now or loaded from the
  cache, once per process; forked workers inherit it, their memory being a copy). Processes sharing a
  cache directory compile a kernel one at a time (a lock file per kernel and signature beside the cache):
  sweep workers that need a kernel the warm-up did not compile wait for the first one's compile and
  load it from the cache, instead of each compiling it again.
- :class:`Kernel`, :func:`table`: a table of kernels called by address is a named tuple of addresses (a field
  per kernel, read by name in jitted code), made from a list of entries (name, kernel, signature).
- :func:`one_compile_at_a_time`: the same lock for a kernel compiled when it is called (not by address):
  each new signature of it is compiled, or loaded from the cache, under the lock.
- :func:`through_address`: a jitted ``call(addr, *args)`` for one signature (the arguments without those the
  signature fixes as literals). Its typing refuses any other argument types, so the code at an address is
  never called with arguments of another layout.

Addresses are run-time values, never constants in compiled code: Numba's on-disk cache stays valid in
every process (the caller receives the address as an argument from Python). The callee runs with
Numba's own calling convention and an error it returns is passed on, as for a linked call. Why not
Numba's first-class functions: they call through the C ABI wrapper, for which arrays are not a type.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import types as pytypes
from collections.abc import Collection, Sequence
from typing import NamedTuple

import numba as nb
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kvfast.kernels.jit import JIT_OPTIONS

_ADDRESSES: dict[tuple, int] = {}


@contextlib.contextmanager
def _one_compile_at_a_time(kernel, signature: tuple):
    """Hold an exclusive lock on a file named after ``kernel`` and ``signature`` in Numba's cache directory
    (released by the system if the process dies); no lock where none can be taken, nor where kvfast's kernels
    are not cached (each process compiles its own)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not a POSIX system
        yield
        return
    if not JIT_OPTIONS["cache"]:
        yield
        return
    key = hashlib.sha256(f"{kernel.py_func.__module__}.{kernel.__qualname__}{signature}".encode()).hexdigest()[:24]
    try:
        directory = os.path.join(os.environ["NUMBA_CACHE_DIR"], "kvfast-locks")
        os.makedirs(directory, exist_ok=True)
        fd = os.open(os.path.join(directory, key), os.O_RDWR | os.O_CREAT, 0o600)
    except (KeyError, OSError):
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


_BY_ADDRESS: dict = {}
BY_ADDRESS_SUFFIX = "__by_address"


def by_address(kernel):
    """``kernel``'s twin for calls by address: the same function (code, globals, defaults), compiled with
    the same options but without the two entry points Numba adds for other callers (a CPython wrapper, to
    be called from Python, and a C-ABI wrapper, to be a first-class function value): about 0.1 s less
    compile per kernel and signature, and less machine code. Its qualified name has
    :data:`BY_ADDRESS_SUFFIX` appended, so Numba's disk cache keeps it in files of its own (the cache keys
    an entry by name and signature, not by options: the twin's entry, lacking the CPython wrapper, must
    never be loaded by the dispatcher Python calls)."""
    twin = _BY_ADDRESS.get(kernel)
    if twin is None:
        f = kernel.py_func
        g = pytypes.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
        g.__qualname__ = f.__qualname__ + BY_ADDRESS_SUFFIX
        g.__module__, g.__doc__, g.__kwdefaults__ = f.__module__, f.__doc__, f.__kwdefaults__
        options = {k: v for k, v in kernel.targetoptions.items() if k != "nopython"}  # njit's own
        # cache: not a target option (kvfast's kernels are all cached or none: JIT_OPTIONS)
        twin = nb.njit(**options, cache=JIT_OPTIONS["cache"], no_cpython_wrapper=True, no_cfunc_wrapper=True)(g)
        _BY_ADDRESS[kernel] = twin
    return twin


def address(kernel, signature: tuple, twin: bool = True) -> int:
    """The address of ``kernel``'s machine code for the argument types ``signature`` (a tuple of Numba
    types, literals included), compiled or loaded from the cache on the first request of a process.
    ``twin``: compile :func:`by_address`'s twin (for a kernel Python never calls in a run: it would compile
    ``kernel`` itself once more), else ``kernel`` itself (one compile for both kinds of caller)."""
    key = (kernel, signature)
    found = _ADDRESSES.get(key)
    if found is None:
        if twin:
            kernel = by_address(kernel)
        if signature not in kernel.overloads:
            with _one_compile_at_a_time(kernel, signature):
                kernel.compile(signature)  # loads what another process compiled meanwhile
        result = kernel.overloads[signature]
        found = result.library.get_pointer_to_function(result.fndesc.mangled_name)
        if not found:  # pragma: no cover - Numba would have raised while compiling
            raise RuntimeError(f"{kernel.__name__}{signature}: no machine code")
        _ADDRESSES[key] = found
    return found


class Kernel(NamedTuple):
    """One entry of a table of kernels called by address (:func:`table`): the record field it fills
    (``name``), the jitted ``function`` (or a function of no argument that returns it, for a kernel written
    out on first use), the argument types it is compiled for (``signature``) and ``twin`` (:func:`address`)."""

    name: str
    function: object
    signature: tuple
    twin: bool = True


def table(entries: Sequence[Kernel], reached: Collection[str]) -> dict[str, int]:
    """``{name: address}`` of every entry: the address of each entry named in ``reached`` (compiled, or loaded from
    the cache, on first use), 0 for the others (the kernels a call cannot reach are never compiled). A table's
    record (a named tuple with one ``int`` field per entry) is made from it by name."""
    return {
        e.name: address(e.function if hasattr(e.function, "py_func") else e.function(), e.signature, e.twin)
        if e.name in reached else 0
        for e in entries
    }  # fmt: skip


def one_compile_at_a_time(kernel):
    """``kernel`` (a Numba dispatcher called from Python), made to compile each new signature under the lock
    :func:`address` takes: processes sharing a cache directory (sweep workers, warm-ups running side by side)
    compile it once, and the others wait and load it from the cache instead of compiling it again. The same
    dispatcher, returned (a decorator above ``@nb.njit``); its calls once compiled are untouched."""
    plain = kernel.compile

    def compile(sig):
        if tuple(sig) in kernel.overloads:
            return plain(sig)
        with _one_compile_at_a_time(kernel, tuple(sig)):
            return plain(sig)  # loads what another process compiled meanwhile

    kernel.compile = compile
    return kernel


def through_address(signature: tuple, restype=types.none):
    """A jitted ``call(addr, *args)`` of the kernel at ``addr`` compiled for ``signature``.

    ``args``: the arguments whose type in ``signature`` is not a literal, in order, each of exactly that type
    (an integer literal at the call site counts as its integer type); a literal of ``signature`` is passed as
    its value. Returns the kernel's result (of type ``restype``). The arguments reach the call as Numba passes
    a ``*args`` (borrowed: no reference count taken per call, unlike a tuple built at the call site).
    """
    passed = tuple(t for t in signature if not isinstance(t, types.Literal))

    @intrinsic
    def call(typingctx, addr, *args):
        if len(args) == 1 and isinstance(args[0], types.StarArgTuple):
            args = args[0].types
        if not isinstance(addr, types.Integer) or tuple(types.unliteral(t) for t in args) != passed:
            return None  # another layout: no call (a typing error names the arguments)

        def codegen(context, builder, sig, llargs):
            fnty = context.call_conv.get_function_type(restype, signature)
            fn = builder.inttoptr(llargs[0], fnty.as_pointer())
            given = iter(cgutils.unpack_tuple(builder, llargs[1], len(passed)))
            values = [
                context.get_constant(types.unliteral(t), t.literal_value)
                if isinstance(t, types.Literal)
                else next(given)
                for t in signature
            ]
            status, result = context.call_conv.call_function(builder, fn, restype, signature, values)
            with cgutils.if_unlikely(builder, status.is_error):
                context.call_conv.return_status_propagate(builder, status)
            return result

        return restype(addr, types.StarArgTuple.from_types(args)), codegen

    return call
