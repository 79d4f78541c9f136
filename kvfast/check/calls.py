"""Every call the checker makes to a model under test, each returning validated logits: :class:`ModelCalls`.

The checker never calls a model's method itself: it calls :class:`ModelCalls`, which runs the
method guarded (:class:`kvfast.check.protocol.GuardedModel`: the model's own exceptions and exits
become :class:`~kvfast.check.protocol.ModelUnderTestError`) and hands back its logits checked by
:func:`kvfast.check.protocol.check_logits` (the expected shape, real and finite numbers) as float64.
``where`` names the call in a bad-logits message (``model.decode at step 3 (position 8): ...``).

Nothing crosses the protocol boundary by reference: every token array handed to the model is a
fresh copy (a model may write into its input), and every logits array handed back is the
checker's own copy (:func:`~kvfast.check.protocol.check_logits`; a model may return one
preallocated buffer on every call), so what the checker keeps and compares is never changed
behind its back.
"""

from __future__ import annotations

import numpy as np

from kvfast.check.protocol import GuardedModel, ModelUnderTestError, check_logits, has, logits_format, variants_of


class ModelCalls:
    """A guarded model under test with ``vocab`` logits per row; each method returns validated float64 logits.

    ``model`` is the guarded model (:func:`as_model_under_test`): reach it for anything that is not a
    logits call (``promote``, attributes).
    """

    def __init__(self, model: GuardedModel, vocab: int):
        self.model = model
        self.vocab = vocab

    def has(self, name: str) -> bool:
        """Whether the model has the optional method ``name``."""
        return has(self.model, name)

    def recompute(self, tokens: np.ndarray, where: str | None = None) -> np.ndarray:
        """``recompute(tokens)``: ``(len(tokens), V)``; ``where`` defaults to ``of the first N tokens``."""
        return self.recompute_with_format(tokens, where)[0]

    def recompute_with_format(self, tokens: np.ndarray, where: str | None = None) -> tuple[np.ndarray, str]:
        """``recompute(tokens)`` and the format its logits came in (:func:`kvfast.check.protocol.logits_format`)."""
        n = tokens.shape[0]
        raw = self.model.recompute(tokens.copy())
        where = f"of the first {n} tokens" if where is None else where
        return check_logits(raw, "recompute", n, self.vocab, where), logits_format(raw)

    def prefill(self, tokens: np.ndarray, where: str) -> np.ndarray:
        """``prefill(tokens)``: ``(len(tokens), V)``."""
        return check_logits(self.model.prefill(tokens.copy()), "prefill", tokens.shape[0], self.vocab, where)

    def extend(self, tokens: np.ndarray, where: str) -> np.ndarray:
        """``extend(tokens)``: ``(len(tokens), V)``."""
        return check_logits(self.model.extend(tokens.copy()), "extend", tokens.shape[0], self.vocab, where)

    def decode(self, token: int, where: str) -> np.ndarray:
        """``decode(token)``: ``(V,)``."""
        return check_logits(self.model.decode(int(token)), "decode", None, self.vocab, where)

    def variants(self, tokens: np.ndarray) -> dict[str, np.ndarray]:
        """``recompute_variants(tokens)`` as ``{name: (len(tokens), V)}`` (empty without the hook)."""
        return variants_of(self.model, tokens.copy(), self.vocab)

    def variants_or_skipped(self, tokens: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """:meth:`variants`, and the variants skipped with the reason: those the model itself reports it could
        not build or run (its optional ``skipped_variants`` attribute, ``{name: reason}``), or every variant
        when ``recompute_variants`` raises (one line naming the call). A variant is order noise, never the
        check: losing one must not lose the verdict. Bad logits from it stay bad input (``ValueError``)."""
        try:
            found = self.variants(tokens)
        except ModelUnderTestError as exc:
            return {}, {"all": " ".join(str(exc).split())}
        skipped = getattr(self.model, "skipped_variants", None)
        skipped = {str(k): str(v) for k, v in skipped.items()} if isinstance(skipped, dict) else {}
        return found, {k: v for k, v in skipped.items() if k not in found}
