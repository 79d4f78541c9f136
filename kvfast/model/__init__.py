"""The tiny transformer, its KV cache, cached decoding and the bug catalogue.

Public functions validate their arguments (:mod:`kvfast.model.validate`);
their ``*_prepared`` twins compute on prepared :class:`~kvfast.model.transformer.Weights`
and validated arguments (see :mod:`kvfast.model.transformer`).
"""
