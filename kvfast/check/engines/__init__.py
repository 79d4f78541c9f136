"""Inference engines as models under test (each an optional extra): :mod:`kvfast.check.engines.ort`
(onnxruntime-genai, ``kvfast[ort]``)."""
