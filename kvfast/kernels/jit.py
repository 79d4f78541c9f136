"""The one set of Numba options every order-sensitive kernel is compiled with.

``fastmath=False`` keeps LLVM from reassociating sums or contracting a multiply
and an add into an FMA: the summation order is the experiment, so no kernel may
change it. ``cache`` stores machine code on disk where kvfast can trust the cache (see ``kvfast.kernels``
for the cache directory and when it cannot), ``nogil`` lets threads run kernels side by side, and
``error_model="numpy"`` (numba) turns a division by zero into inf/nan instead of raising.
"""

from kvfast.kernels import CACHED

JIT_OPTIONS = {"cache": CACHED, "nogil": True, "fastmath": False, "error_model": "numpy"}

BORROWING = {**JIT_OPTIONS, "_nrt": False}
""":data:`JIT_OPTIONS` for a kernel that only reads and writes arrays its caller holds: it allocates no array and
returns none, so it takes no reference count (Numba's runtime off). Compiled with the runtime, every array
argument, record member and view costs an atomic increment and decrement, each a call: a fifth of a one-row
forward's time (the block's functions take records of 12 and 13 arrays). Numba refuses to compile an
allocation (``np.empty``) in such a kernel; the arithmetic is the same, so are the bits. ``_nrt`` is Numba's own
option (private; read by Numba 0.60 to 0.68): a release that drops it refuses every kernel compiled with it, so the
whole test suite fails at once."""
