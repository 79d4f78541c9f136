"""The model-under-test protocol and the validation of everything a model hands back.

A model under test is any object with these methods (tokens are passed as a
1-D ``numpy.int64`` array, a single token as a Python ``int``):

``recompute(tokens) -> logits (T, V)``
    A full forward of ``tokens`` from position 0, with no cache. It must not
    touch the cache that ``prefill``/``decode`` use.
``prefill(tokens) -> logits (T, V)``
    Reset the cache, then run ``tokens`` from position 0 and store their keys
    and values.
``decode(token) -> logits (V,)``
    One new token at the cache's next position, over the cache; appends its K/V.
``extend(tokens) -> logits (n, V)`` (optional)
    A further chunk on top of the cache (chunked prefill, a resumed session).
``decode_greedy(token, n) -> logits (n, V)`` (optional, a shortcut)
    ``n`` decode steps in one call: the first fed ``token``, each next fed the
    argmax (first maximum) of the step before's logits; the logits ``n`` calls
    of ``decode`` so fed return, row ``i`` from step ``i + 1``. The checker asks
    for it where it feeds greedy tokens (it then derives the tokens fed from
    the rows it gets, so a hook that feeds others shows as a divergence). It may
    decline with ``NotImplementedError`` before it decodes anything (the cache
    as it was): the checker then calls ``decode`` step by step.
``recompute_prefixes(tokens, lengths) -> [logits (n, V) for n in lengths]`` (optional, a shortcut)
    The recomputes of several prefixes of ``tokens`` in one call: element ``i`` is
    what ``recompute(tokens[:lengths[i]])`` returns (each length at most
    ``len(tokens)``). The checker asks for it where it recomputes a sequence and a
    prefix of it (the append-invariance check). It may decline with
    ``NotImplementedError``: the checker then calls ``recompute`` once per prefix.
``recompute_variants(tokens) -> {name: logits (T, V)}`` (optional, control mode)
    Full recomputes of ``tokens`` that differ from ``recompute`` ONLY in how they
    add up (another batching, another kernel's summation order); never through
    the cache. A list is accepted too (named ``variant0``, ``variant1``, ...).
    If it raises, control mode goes on without variants (a note names the
    call and the error); bad logits from it are bad input.
``skipped_variants`` (optional attribute, ``{name: reason}``)
    Variants the model could not build or run (an eager-only model asked for
    another attention): the report names each with its reason.
``promote(dtype) -> model under test`` (optional)
    The same model (its bug included) computing in ``dtype`` (``"float64"``):
    the logic check ``check_cache(..., promote="float64")``. If the model cannot
    be promoted or cannot run promoted, the logic check is skipped with a note
    and the native verdict stands.
``internal_formats`` (optional attribute, ``{what: format}``)
    The formats the model computes in inside, where they are lower than its
    logits' (``{"kv cache": "float16"}``, ``{"activations": "int8"}``,
    ``{"softmax": "float32"}``; formats: :data:`kvfast.check.formats.FORMATS`).
    The lowest of them and the logits' format sets the floor of every bound in
    control mode and the ceiling below which order noise is admitted
    (:mod:`kvfast.check.formats`). Absent: kvfast assumes the logits' format
    (and says so in a note); Hugging Face models have it measured. An optional
    ``internal_formats_source`` (``"declared"``, the default, or ``"measured"``)
    says where it came from.
``crop(n)`` (optional; the ``rollback`` scenario, :mod:`kvfast.check.scenarios`)
    Keep the first ``n`` positions of the cache and forget the rest (speculative
    decoding's rollback); the next ``decode`` is at position ``n``.
``snapshot() -> state`` and ``restore(state)`` (optional; the ``fork`` scenario)
    A copy of the cache as it is now, and the cache set back to a copy of it (a
    state may be restored more than once; no branch may change another).
``prefill_beams(tokens, n) -> logits (n, T, V)``, ``decode_beams(tokens) -> logits (n, V)`` and
``reorder(index)`` (optional; the ``reorder`` scenario, beam search)
    A fresh cache of ``n`` beams of ``tokens``; one token per beam; the cache's
    beams reordered so that beam ``i`` holds what beam ``index[i]`` held.
``prefill_padded(prompts) -> [logits (T_i, V)]`` and ``decode_padded(tokens) -> logits (n, V)``
(optional; the ``padded`` scenario, batched generation)
    A fresh cache of prompts of different lengths as one left-padded batch
    (each prompt's logits, pads dropped); one token per row.
    A hook that raises ``NotImplementedError`` (a cache kind that cannot roll
    back) gets its scenario skipped with a note, never a failed check.
``lossy_cache`` (optional attribute, a format name) and ``lossless() -> model under test``
    A cache that stores keys and values in a lossy format (``int8``, ``fp8``):
    every scenario is then judged as one (:mod:`kvfast.check.lossy`, verdict
    ``lossy``, never ``exact`` or ``rounding``) against ``lossless()``, the same
    model with its cache unquantized.
``prepare_check(plan) -> [note, ...] | None`` (optional)
    Called once before any other call of a check with a :class:`CheckPlan`, a plain record of what the check
    will do: the prompt, the resume scenario's split, the decode steps, the scenarios asked for, and whether
    it judges against the model's measured order noise (``measures_noise``: the default ``auto`` and
    ``control`` modes) or bit for bit (``exact`` mode). A model that computes one way for a bit-for-bit check
    and another for a noise-judged one sets itself up here (vLLM pins its GEMMs' row count for exact mode
    where it changes their arithmetic); a model may start work ahead here too, every call then returning what
    it would have returned without the plan, bit for bit. The notes it returns (strings) head the report's
    notes: what it chose and why.
``max_positions`` (optional attribute, int)
    The most positions the model can take; a longer check is bad input before any work.
``vocab_size`` (optional attribute, int)
    The vocabulary size. Without it the checker learns it from the logits of
    ``recompute([0])``.

Logits may be anything :func:`numpy.asarray` accepts, a CPU torch tensor
included (a tensor is detached and a bfloat16 one widened to float32 first,
both exact). A leading batch axis of size 1 is dropped. Logits must be finite.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NoReturn

import numpy as np

# CheckTimeout, check_timeout, describe and watched are re-exported here, where the checker has always named them
from kvfast.runtime import CheckTimeout, UserCodeError, call_user, check_timeout, describe, watched  # noqa: F401
from kvfast.validation import require_int

REQUIRED = ("recompute", "prefill", "decode")
OPTIONAL = (
    "extend", "decode_greedy", "recompute_prefixes", "recompute_variants", "promote", "crop", "snapshot", "restore",
    "lossless", "prefill_beams", "decode_beams", "reorder", "prefill_padded", "decode_padded", "prepare_check",
)  # fmt: skip
PROTOCOL_METHODS = frozenset(REQUIRED + OPTIONAL)
PROTOCOL = "an object with recompute(tokens), prefill(tokens), decode(token) and optionally extend(tokens)"


def require_model(model: object) -> None:
    """Raise ``ValueError`` naming the first required method ``model`` lacks (or saying it is a class, not
    an instance: a class has the methods, unbound); a method that raises when read is the model's
    (:func:`read_attribute`)."""
    if isinstance(model, type):
        raise ValueError(f"model: the class {model.__name__} is not allowed; allowed: an instance of it, {PROTOCOL}")
    for name in REQUIRED:
        if not callable(read_attribute(model, name)):
            raise ValueError(f"model: {type(model).__name__} has no method {name!r}; allowed: {PROTOCOL}")
    for name in OPTIONAL:
        value = read_attribute(model, name)
        if value is not None and not callable(value):
            raise ValueError(f"model.{name}: {value!r} is not callable; allowed: a method or absent")


def read_attribute(model: object, name: str, default: object = None) -> object:
    """The model's attribute ``name`` (an optional method or a declaration: ``internal_formats``,
    ``lossy_cache``, ``vocab_size``, ``max_positions``), ``default`` when it has none. Reading it runs the
    model's code (a property; a mapping's items): whatever that raises is the model's failure,
    :class:`ModelUnderTestError` naming ``model.NAME`` (:func:`call_model`; an ``AttributeError`` reads as
    absent, as for :func:`getattr`). A mapping comes back as a ``dict`` read once, so that validating it
    runs no more of the model's code."""
    guarded = isinstance(model, GuardedModel)
    raw = model.wrapped if guarded else model
    try:
        value = getattr(raw, name, default)
        if type(value) in _NO_MAPPING:  # a method, None, a number, a string: no Mapping to read (no ABC check)
            return value
        return dict(value.items()) if isinstance(value, Mapping) else value
    except BaseException as exc:  # noqa: BLE001 - classified by call_model, as if it had made the read
        model_failed(f"model.{name}", exc, model.passthrough if guarded else ())


#: Types whose instances are never a ``Mapping`` (exactly these types, not subclasses).
_NO_MAPPING = frozenset((types.MethodType, types.FunctionType, type(None), bool, int, float, str))


def has(model: object, name: str) -> bool:
    """Whether ``model`` has the optional method ``name``."""
    return callable(read_attribute(model, name))


def to_numpy(value: object) -> np.ndarray:
    """``value`` as a NumPy array without changing any number (torch tensors included)."""
    if type(value) is np.ndarray:  # already an array (the common case): nothing to convert
        arr = value
    else:
        if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor, without importing torch
            value = value.detach().cpu()
            if str(getattr(value, "dtype", "")) == "torch.bfloat16":
                value = value.float()  # exact: every bfloat16 is a float32
        try:
            arr = np.asarray(value)
        except Exception as exc:  # noqa: BLE001 - any conversion failure is the model's bad output
            raise ValueError(
                f"logits: {type(value).__name__} cannot be read by numpy.asarray ({exc}); allowed: an array-like"
            ) from exc
    if arr.dtype.kind == "V" and str(arr.dtype) == "bfloat16":
        arr = arr.astype(np.float32)  # an ml_dtypes bfloat16 array: exact, as for torch's
    return arr


def check_logits(value: object, method: str, rows: int | None, vocab: int | None, where: str = "") -> np.ndarray:
    """Validate logits returned by ``model.<method>``; return them as float64.

    ``rows`` is the expected number of rows (``None``: one row, shape ``(V,)``).
    ``vocab`` is the expected ``V`` (``None``: any positive size). A leading
    axis of size 1 is dropped. Raises ``ValueError`` for a non-numeric dtype, a
    wrong shape or a non-finite value. The result is always a fresh array, never
    the model's own buffer (a model may return the same buffer on every call).
    """
    arr = to_numpy(value)
    want_ndim = 1 if rows is None else 2
    if arr.ndim == want_ndim + 1 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.dtype.kind not in "fiu":
        raise ValueError(
            f"model.{method}{_at(where)}: logits of dtype {arr.dtype} are not allowed; allowed: real numbers"
        )
    shape = arr.shape
    ok = (
        arr.ndim == want_ndim
        and shape[-1] >= 1
        and (rows is None or shape[0] == rows)
        and (vocab is None or shape[-1] == vocab)
    )
    if not ok:
        v = "V" if vocab is None else str(vocab)
        expected = f"({v},)" if rows is None else f"({rows}, {v})"
        raise ValueError(f"model.{method}{_at(where)}: logits of shape {shape} are not allowed; allowed: {expected}")
    arr = np.array(arr, dtype=np.float64)  # the checker's own copy: a model may reuse its output buffer
    finite = np.isfinite(arr)
    if np.count_nonzero(finite) != finite.size:  # (a count: a third of a reduction's cost on a small array)
        idx = np.argwhere(~finite)[0]
        bad = arr[tuple(idx)]
        raise ValueError(
            f"model.{method}{_at(where)}: logits hold {bad} at index {tuple(int(i) for i in idx)}; "
            "allowed: finite numbers"
        )
    return arr


def _at(where: str) -> str:
    return f" {where}" if where else ""


def check_prompt(prompt: object) -> np.ndarray:
    """A non-empty 1-D sequence of non-negative integer token ids, as int64."""
    arr = to_numpy(prompt)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"prompt: shape {arr.shape} is not allowed; allowed: a non-empty 1-D sequence of token ids")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"prompt: dtype {arr.dtype} is not allowed; allowed: integer token ids")
    if arr[arr.argmin()] < 0:  # (the least token by its index: no reduction's set-up on a short prompt)
        raise ValueError(f"prompt: token {int(arr[arr < 0][0])} is out of range; allowed: integers >= 0")
    return arr.astype(np.int64)


def check_range(prompt: np.ndarray, vocab: int, field: str = "prompt") -> None:
    """Raise ``ValueError`` if a token of ``field`` is not in ``[0, vocab)``."""
    if prompt.size and prompt[prompt.argmax()] >= vocab:  # (as check_prompt: the largest by its index)
        bad = prompt >= vocab
        raise ValueError(f"{field}: token {int(prompt[bad][0])} is out of range; allowed: integers in [0, {vocab})")


def logits_format(value: object) -> str:
    """The floating-point format a model's logits come in (before any widening): ``bfloat16``, ``float16``,
    ``float32`` or ``float64`` (integers and anything else: ``float64``)."""
    dtype = getattr(value, "dtype", "")
    known = _NUMPY_FORMATS.get(dtype) if isinstance(dtype, np.dtype) else None  # numpy's own: no text (issue 46)
    if known is not None:
        return known
    name = str(dtype).removeprefix("torch.")  # ml_dtypes' and torch's dtypes by name
    return name if name in LOGITS_FORMATS else "float64"


LOGITS_FORMATS = ("bfloat16", "float16", "float32", "float64")
_NUMPY_FORMATS = {np.dtype(name): name for name in LOGITS_FORMATS[1:]}


def vocab_of(model: object) -> int:
    """The model's vocabulary size: ``model.vocab_size`` if it is an int, else from ``recompute([0])``."""
    declared = read_attribute(model, "vocab_size")
    if declared is not None:
        return require_int(declared, "model.vocab_size", 1)
    probe = check_logits(model.recompute(np.zeros(1, dtype=np.int64)), "recompute", 1, None, "of [0]")
    return int(probe.shape[1])


# --- the model's own failures and the check's deadline (the machinery: kvfast.runtime) ------------


@dataclass(frozen=True)
class CheckPlan:
    """What a check will do, the record a model's ``prepare_check(plan)`` receives (see the module doc):
    ``prompt`` (``numpy.int64``, the model's own copy), ``split`` (the resume scenario's), ``steps`` (decode
    steps), ``scenarios`` (the names asked for) and ``measures_noise`` (the check judges the cache against the
    model's measured order noise, as the ``auto`` and ``control`` modes do; ``False``: bit for bit, ``exact``)."""

    prompt: np.ndarray
    split: int
    steps: int
    scenarios: tuple[str, ...]
    measures_noise: bool


class ModelUnderTestError(UserCodeError):
    """The model under test (or its factory, or its module) raised or exited instead of returning.

    Raised by :func:`kvfast.check_cache` (and ``kvfast check``'s factory loading) for ANY exception
    the model's own code raises, ``SystemExit`` (``sys.exit(0)`` included) and ``KeyboardInterrupt``
    included, chained from it (``__cause__``). ``where`` names the call (``model.decode(5)``),
    ``error`` is the original exception; ``str()`` is one line: where, the type and the message.
    A :class:`kvfast.runtime.UserCodeError`.
    """


def call_model(where: str, fn: Callable, *args, passthrough: tuple[type[BaseException], ...] = (), **kwargs):
    """``fn(*args, **kwargs)``: code of the model under test, through :func:`kvfast.runtime.call_user`:
    whatever it raises (``SystemExit``, ``KeyboardInterrupt`` and every other exception; except
    ``passthrough`` types and a Ctrl-C from the user) becomes :class:`ModelUnderTestError` chained from
    it; the watched deadline (:func:`watched`), :class:`CheckTimeout`."""
    return call_user(where, fn, *args, passthrough=passthrough, error=ModelUnderTestError, **kwargs)


def model_failed(where: str, error: BaseException, passthrough: tuple[type[BaseException], ...] = ()) -> NoReturn:
    """Raise what :func:`call_model` raises for ``where`` when the model's code raised ``error`` (caught by the
    caller, which ran that code itself: a call that returns pays no wrapper and formats no ``where``): the same
    exception from the same decision (:func:`kvfast.runtime.call_user`)."""

    def again() -> NoReturn:
        raise error

    call_model(where, again, passthrough=passthrough)
    raise AssertionError("unreachable: call_model re-raises what again() raises")  # pragma: no cover


def _arg_text(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"<{value.shape[0]} tokens>" if value.ndim == 1 else f"<array {value.shape}>"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class GuardedModel:
    """A model under test seen through :func:`call_model`: each of its protocol methods (and attribute
    reads) runs guarded, so the model's own exceptions and exits become :class:`ModelUnderTestError`
    naming the call (``model.decode(5)``). Everything else passes through; ``promote`` returns a
    guarded model too. ``wrapped`` is the model itself; ``passthrough``: exception types that stay
    as they are (``ValueError`` for kvfast's own adapters, whose bad-input errors are documented)."""

    def __init__(self, model: object, passthrough: tuple[type[BaseException], ...] = ()):
        object.__setattr__(self, "wrapped", model)
        object.__setattr__(self, "passthrough", passthrough)

    def __getattr__(self, name: str):
        value = _read_method(self.wrapped, name)
        if name not in PROTOCOL_METHODS or not callable(value):
            return value

        def method(*args):
            out = call_method(self, name, *args)
            return guard(out, self.passthrough) if name == "promote" else out

        return method


def call_method(model: GuardedModel, name: str, *args):
    """``model.<name>(*args)`` guarded: the model's own exceptions and exits become :class:`ModelUnderTestError`
    naming the call (``model.decode(5)``; ``model.passthrough`` types stay as they are). What a
    :class:`GuardedModel`'s methods run, and :class:`ModelCalls` without their wrapper per call: the logits calls
    are most of a check's calls (issue 46)."""
    method = _read_method(model.wrapped, name)
    try:
        return method(*args)
    except BaseException as exc:  # noqa: BLE001 - classified by call_model, naming the call
        model_failed(f"model.{name}({', '.join(map(_arg_text, args))})", exc, model.passthrough)


def _read_method(model: object, name: str) -> object:
    """``model.<name>``, what reading it raises classified as :func:`call_model` does (``AttributeError``: absent)."""
    try:
        return getattr(model, name)
    except BaseException as exc:  # noqa: BLE001 - classified by call_model (AttributeError: absent)
        model_failed(f"model.{name}", exc, (AttributeError,))


def guard(model: object, passthrough: tuple[type[BaseException], ...] = ()) -> object:
    """``model`` as a :class:`GuardedModel` (once)."""
    return model if isinstance(model, GuardedModel) else GuardedModel(model, passthrough)


def model_name(model: object) -> str:
    """The model's class name (seen through a :class:`GuardedModel`)."""
    return type(model.wrapped if isinstance(model, GuardedModel) else model).__name__


# --- the checker's calls ------------------------------------------------------------------------------------


class ModelCalls:
    """Every call the checker makes to a model under test (``model``, guarded: :func:`guard`, with ``vocab``
    logits per row), each returning validated float64 logits.

    The checker never calls a model's method itself: it calls :class:`ModelCalls`, which runs the
    method guarded (:class:`GuardedModel`: the model's own exceptions and exits become
    :class:`ModelUnderTestError`) and hands back its logits checked by :func:`check_logits` (the
    expected shape, real and finite numbers) as float64.
    ``where`` names the call in a bad-logits message (``model.decode at step 3 (position 8): ...``).

    Nothing crosses the protocol boundary by reference: every token array handed to the model is a
    fresh copy (a model may write into its input), and every logits array handed back is the
    checker's own copy (:func:`~kvfast.check.protocol.check_logits`; a model may return one
    preallocated buffer on every call), so what the checker keeps and compares is never changed
    behind its back.

    ``model`` is the guarded model (:func:`kvfast.check.subject.as_model_under_test`): reach it for anything
    that is not a logits call (``promote``, attributes).
    """

    def __init__(self, model: GuardedModel, vocab: int):
        self.model = model
        self.vocab = vocab

    def _call(self, name: str, *args):
        return call_method(self.model, name, *args)

    def has(self, name: str) -> bool:
        """Whether the model has the optional method ``name``."""
        return has(self.model, name)

    def prepare(self, plan: CheckPlan) -> list[str]:
        """``prepare_check(plan)`` (for a model that has it: the caller asks :meth:`has` first, before building the
        plan): the model set up for this check, and its notes for the report. ``ValueError`` unless it returns
        ``None`` or a list or tuple of strings."""
        notes = self.model.prepare_check(plan)
        if notes is None:
            return []
        if not isinstance(notes, list | tuple) or not all(isinstance(n, str) for n in notes):
            raise ValueError(
                f"model.prepare_check: {type(notes).__name__} is not allowed; allowed: None or a list of str (notes)"
            )
        return list(notes)

    def recompute(self, tokens: np.ndarray, where: str | None = None, with_format: bool = False):
        """``recompute(tokens)``: ``(len(tokens), V)``; ``where`` defaults to ``of the first N tokens``. With
        ``with_format``: ``(logits, the format they came in)`` (:func:`kvfast.check.protocol.logits_format`)."""
        n = tokens.shape[0]
        raw = self._call("recompute", tokens.copy())
        rows = check_logits(raw, "recompute", n, self.vocab, f"of the first {n} tokens" if where is None else where)
        return (rows, logits_format(raw)) if with_format else rows

    def recompute_prefixes(self, tokens: np.ndarray, lengths: tuple[int, ...], wheres: tuple[str, ...]) -> list:
        """``recompute(tokens[:n])`` for each ``n`` of ``lengths`` (``wheres``: each one's ``where``), in one call
        where the model has ``recompute_prefixes`` and takes it, else one :meth:`recompute` each."""
        if self.has("recompute_prefixes"):
            try:
                raw = self._call("recompute_prefixes", tokens.copy(), list(lengths))
            except ModelUnderTestError as exc:
                if not isinstance(exc.error, NotImplementedError):
                    raise
            else:
                if not isinstance(raw, list | tuple) or len(raw) != len(lengths):
                    raise ValueError(
                        f"model.recompute_prefixes: returned {type(raw).__name__}; allowed: a list of "
                        f"{len(lengths)} logits arrays, one per length"
                    )
                return [
                    check_logits(r, "recompute_prefixes", n, self.vocab, where)
                    for r, n, where in zip(raw, lengths, wheres, strict=True)
                ]
        return [self.recompute(tokens[:n], where) for n, where in zip(lengths, wheres, strict=True)]

    def prefill(self, tokens: np.ndarray, where: str) -> np.ndarray:
        """``prefill(tokens)``: ``(len(tokens), V)``."""
        return check_logits(self._call("prefill", tokens.copy()), "prefill", tokens.shape[0], self.vocab, where)

    def extend(self, tokens: np.ndarray, where: str) -> np.ndarray:
        """``extend(tokens)``: ``(len(tokens), V)``."""
        return check_logits(self._call("extend", tokens.copy()), "extend", tokens.shape[0], self.vocab, where)

    def decode(self, token: int, where: str) -> np.ndarray:
        """``decode(token)``: ``(V,)``."""
        return check_logits(self._call("decode", int(token)), "decode", None, self.vocab, where)

    def decode_greedy(self, token: int, steps: int, where: str) -> np.ndarray | None:
        """``decode_greedy(token, steps)``: ``(steps, V)``; ``None`` when the model declines it
        (``NotImplementedError``)."""
        try:
            raw = self._call("decode_greedy", int(token), int(steps))
        except ModelUnderTestError as exc:
            if isinstance(exc.error, NotImplementedError):
                return None
            raise
        return check_logits(raw, "decode_greedy", steps, self.vocab, where)

    def variants_or_skipped(self, tokens: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """``recompute_variants(tokens)`` validated, as ``{name: (len(tokens), V) float64}`` (a list is named
        ``variant0``, ``variant1``, ...), and the variants skipped with the reason: those the model itself reports
        it could not build or run (its optional ``skipped_variants`` attribute, ``{name: reason}``), or every
        variant when ``recompute_variants`` raises (one line naming the call). A variant is order noise, never the
        check: losing one must not lose the verdict. Bad logits from it stay bad input (``ValueError``)."""
        try:
            raw = self.model.recompute_variants(tokens.copy())
        except ModelUnderTestError as exc:
            return {}, {"all": " ".join(str(exc).split())}
        if isinstance(raw, dict):
            items = list(raw.items())
        elif isinstance(raw, list | tuple):
            items = [(f"variant{i}", v) for i, v in enumerate(raw)]
        else:
            raise ValueError(
                f"model.recompute_variants: returned {type(raw).__name__}; allowed: a dict or list of logits arrays"
            )
        n = tokens.shape[0]
        found = {str(k): check_logits(v, "recompute_variants", n, self.vocab, f"[{k!r}]") for k, v in items}
        skipped = read_attribute(self.model, "skipped_variants")
        skipped = {str(k): str(v) for k, v in skipped.items()} if isinstance(skipped, dict) else {}
        return found, {k: v for k, v in skipped.items() if k not in found}
