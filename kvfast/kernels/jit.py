"""The one set of Numba options every order-sensitive kernel is compiled with.

``fastmath=False`` keeps LLVM from reassociating sums or contracting a multiply
and an add into an FMA: the summation order is the experiment, so no kernel may
change it. ``cache`` stores machine code on disk where kvfast can trust the cache (see ``kvfast.kernels``
for the cache directory and when it cannot), ``nogil`` lets threads run kernels side by side, and
``error_model="numpy"`` (numba) turns a division by zero into inf/nan instead of raising.
"""

from kvfast.kernels import CACHED

JIT_OPTIONS = {"cache": CACHED, "nogil": True, "fastmath": False, "error_model": "numpy"}
