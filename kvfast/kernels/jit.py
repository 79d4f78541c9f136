"""The one set of Numba options every order-sensitive kernel is compiled with.

``fastmath=False`` keeps LLVM from reassociating sums or contracting a multiply
and an add into an FMA: the summation order is the experiment, so no kernel may
change it. ``cache=True`` stores machine code on disk (see ``kvfast.kernels``
for the cache directory), ``nogil`` lets threads run kernels side by side, and
``error_model="numpy"`` (numba) turns a division by zero into inf/nan instead of raising.
"""

JIT_OPTIONS = {"cache": True, "nogil": True, "fastmath": False, "error_model": "numpy"}
