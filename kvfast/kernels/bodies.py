"""Kernel bodies written once, compiled once per accumulator format with the rounding written out.

A hot kernel whose arithmetic depends on the accumulator format (the product bodies of
:mod:`kvfast.kernels.matmul`, the score dots of :mod:`kvfast.kernels.attention`) is written once, as a plain
Python *template* whose products and sums are the macros :func:`MUL`, :func:`ADD` and :func:`MAC` (its scratch
arrays :func:`EMPTY`, of the body's data type); :func:`specialise` rewrites the template's syntax tree for one
format, each macro becoming the operation and its rounding written out (``MAC(s, a, b)`` for the f32
accumulator on float64 data: ``np.float64(np.float32(s + np.float64(np.float32(a * b))))``), and compiles the
result with :data:`kvfast.kernels.jit.JIT_OPTIONS`. The loops carry no format branch, and Numba types and
lowers plain arithmetic, not a call to a jitted helper per operation nor an ``@overload`` chosen by a literal
format per call, nor a copy of helper functions inlined in Numba IR (the former form, which cost about two
thirds of each body's cold compile: ``benchmarks/README.md``, "Issue 30, fourth pass").

The roundings (the operation in float64, or in float32 on float32 data, then):

========== ============ ===================================== =============================================
accumulator data         product ``MUL(a, b)``                 sum ``ADD(a, b)``
========== ============ ===================================== =============================================
f64        float64       ``a * b``                             ``a + b``
f32        float32       ``a * b`` (native float32)            ``a + b`` (native float32)
f32        float64       ``float64(float32(a * b))``           ``float64(float32(a + b))``
bf16       float32       ``bf16_round_f32_not_nan(a * b)``     ``bf16_round_f32(a + b)``
bf16       float64       ``_rbf(a * b)``                       ``_rbf(a + b)``
========== ============ ===================================== =============================================

(bf16 on float32 data: the product of two finite bfloat16s is never NaN, see
:mod:`kvfast.kernels.matmul`.) These are exactly the roundings of :func:`kvfast.kernels.precision.rnd`
per operation; the naive twins in ``tests/kernels/test_kernels.py`` check every body bit for bit.

The generated function is defined in the template's module (its name: the template's, less a trailing
``_template``, plus the format's suffix, e.g. ``_product_f32_on_f32``), with the template's file and
line numbers, so Numba's disk cache and error messages point at the template's source.
"""

from __future__ import annotations

import ast
import functools
import textwrap

import numba as nb
import numpy as np

from kvfast.kernels.jit import JIT_OPTIONS
from kvfast.kernels.precision import BF16, F32, F64, FORMAT_NAMES, _rbf, bf16_round_f32, bf16_round_f32_not_nan

_HELPERS = {
    "_kvfast_np": np,
    "_kvfast_rbf": _rbf,
    "_kvfast_bf16_round_f32": bf16_round_f32,
    "_kvfast_bf16_round_f32_not_nan": bf16_round_f32_not_nan,
}
"""The names the written-out roundings use, put into the template's module (prefixed, so no clash)."""

_F32_ROUND = ("_kvfast_np.float64", "_kvfast_np.float32")
ROUNDINGS = {
    (F64, False): ((), ()),
    (F32, True): ((), ()),
    (F32, False): (_F32_ROUND, _F32_ROUND),
    (BF16, True): (("_kvfast_bf16_round_f32_not_nan",), ("_kvfast_bf16_round_f32",)),
    (BF16, False): (("_kvfast_rbf",), ("_kvfast_rbf",)),
}
"""``(acc, float32 data) -> (product rounding, sum rounding)``, each the functions applied to the exact result,
outermost first (``()``: none; f32 on float64 data: ``float64(float32(v))``)."""


def MUL(a, b):  # noqa: N802 - a macro, named so
    """A product rounded to the accumulator format (a macro of a template: :func:`specialise`)."""
    raise NotImplementedError("a template macro: only meaningful in a template given to specialise()")


def ADD(a, b):  # noqa: N802
    """A sum rounded to the accumulator format (a macro of a template: :func:`specialise`)."""
    raise NotImplementedError("a template macro: only meaningful in a template given to specialise()")


def EMPTY(shape):  # noqa: N802
    """``np.empty(shape)`` of the body's data type: float64 (the form kvfast's other kernels allocate with, so
    Numba compiles ``np.empty`` once for both) or float32 (a macro of a template: :func:`specialise`)."""
    raise NotImplementedError("a template macro: only meaningful in a template given to specialise()")


def MAC(s, a, b):  # noqa: N802
    """``ADD(s, MUL(a, b))``: two roundings, never fused (a macro of a template: :func:`specialise`)."""
    raise NotImplementedError("a template macro: only meaningful in a template given to specialise()")


def _located(node: ast.AST, where: ast.AST) -> ast.AST:
    """``node`` at ``where``'s place in the source (for error messages; a new node has none)."""
    for field in ("lineno", "col_offset", "end_lineno", "end_col_offset"):
        setattr(node, field, getattr(where, field))
    return node


class _WriteOut(ast.NodeTransformer):
    """Replace every ``MUL``/``ADD``/``MAC`` call by its operation and rounding, and ``EMPTY`` by ``np.empty`` of
    the data type (built as nodes, not parsed: this runs at import, for every body)."""

    def __init__(self, mul: tuple[str, ...], add: tuple[str, ...], data32: bool):
        self.rounding = {"MUL": (ast.Mult, mul), "ADD": (ast.Add, add)}
        self.data32 = data32

    def _function(self, dotted: str, where: ast.AST) -> ast.expr:
        head, *rest = dotted.split(".")
        node = _located(ast.Name(id=head, ctx=ast.Load()), where)
        for attr in rest:
            node = _located(ast.Attribute(value=node, attr=attr, ctx=ast.Load()), where)
        return node

    def _rounded(self, op_name: str, a: ast.expr, b: ast.expr, where: ast.AST) -> ast.expr:
        op, chain = self.rounding[op_name]
        value = _located(ast.BinOp(left=a, op=op(), right=b), where)
        for dotted in reversed(chain):  # the innermost function first
            value = _located(ast.Call(func=self._function(dotted, where), args=[value], keywords=[]), where)
        return value

    def visit_Call(self, node):  # noqa: N802
        self.generic_visit(node)
        name = node.func.id if isinstance(node.func, ast.Name) else None
        if name in ("MUL", "ADD"):
            if len(node.args) != 2 or node.keywords:
                raise ValueError(f"{name}: takes two arguments")
            return self._rounded(name, *node.args, node)
        if name == "EMPTY":
            if len(node.args) != 1 or node.keywords:
                raise ValueError("EMPTY: takes one argument")
            f32 = [_located(ast.keyword(arg="dtype", value=self._function("_kvfast_np.float32", node)), node)]
            f32 = f32 if self.data32 else []
            empty = ast.Call(func=self._function("_kvfast_np.empty", node), args=node.args, keywords=f32)
            return _located(empty, node)
        if name == "MAC":
            if len(node.args) != 3 or node.keywords:
                raise ValueError("MAC: takes three arguments")
            s, a, b = node.args
            return self._rounded("ADD", s, self._rounded("MUL", a, b, node), node)
        return node


@functools.cache
def _module_functions(filename: str) -> tuple[list[str], dict[int, ast.FunctionDef]]:
    """The lines of a source file and its top-level functions by first line (parsed once per file: the
    C parser is faster than ``inspect.getsourcelines``'s tokenizer, and this runs at import)."""
    with open(filename, encoding="utf-8") as fh:
        text = fh.read()
    nodes = {n.lineno: n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and not n.decorator_list}
    return text.splitlines(keepends=True), nodes


def _template_source(template) -> tuple[str, int, str]:
    """The template's source, its first line number and its file."""
    filename = template.__code__.co_filename
    lines, nodes = _module_functions(filename)
    node = nodes[template.__code__.co_firstlineno]  # a module-level function without decorators
    return textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno])), node.lineno, filename


def body_name(template, acc: int, data32: bool, base: str | None = None) -> str:
    """The name :func:`specialise` gives the body of ``template`` for ``acc`` on float32 (``data32``) or
    float64 data: ``base`` (default: the template's name less ``_template``), the format, ``_on_f32``."""
    base = base or template.__name__.removesuffix("_template")
    return f"{base}_{FORMAT_NAMES[acc]}" + ("_on_f32" if data32 else "")


def specialise(template, acc: int, data32: bool, base: str | None = None):
    """``template`` (a plain Python function using :func:`MUL`, :func:`ADD`, :func:`MAC`) with every macro
    written out for accumulator ``acc`` on float32 (``data32``) or float64 data, defined in the template's
    module as :func:`body_name` and jitted with ``JIT_OPTIONS`` (compiled on its first call or
    ``.compile``). ValueError for a format and data type with no rounding (f64 on float32 data)."""
    rounding = ROUNDINGS.get((acc, bool(data32)))
    if rounding is None:
        raise ValueError(f"acc: {acc!r} on {'float32' if data32 else 'float64'} data is not allowed; allowed: "
                         f"{sorted(ROUNDINGS)}")  # fmt: skip
    source, first, filename = _template_source(template)
    tree = ast.parse("\n" * (first - 1) + source)  # at the template's own line numbers
    (fn,) = tree.body
    fn.name = body_name(template, acc, data32, base)
    fn.decorator_list = []
    tree = _WriteOut(*rounding, bool(data32)).visit(tree)
    namespace = template.__globals__
    namespace.update(_HELPERS)
    exec(compile(tree, filename, "exec"), namespace)  # noqa: S102 - our own source
    namespace[fn.name] = jitted = nb.njit(**JIT_OPTIONS)(namespace[fn.name])
    return jitted
