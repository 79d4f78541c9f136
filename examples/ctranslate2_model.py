"""A worked example: CTranslate2's KV cache under kvfast's check protocol (``pip install ctranslate2``).

CTranslate2 keeps no cache between calls: its cache lives inside one ``generate_batch`` call. So ``decode``
replays the sequence: ``generate_batch(prefix + [token], max_length=1)`` runs the prefix through the model,
then the last token as one decode step over that cache, and returns the logits of that step. Every step of a
check is thus a one-step cached decode at that length (quadratic in the steps: fine for tiny models). The
prompt's rows come from ``forward_batch`` (the recompute): CTranslate2 does not return the prefill's own rows,
so step 0 compares the recompute with itself. No ``extend``: the resume scenario's second chunk goes through
``decode`` (the report says so).

Run it: ``python examples/ctranslate2_model.py`` (builds a tiny random Llama and converts it; ~20 s).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

COMPUTE = {"float32": {"compute": "float32"}, "int8": {"compute": "float32", "activations": "int8"}}


class CT2Model:
    """A CTranslate2 generator directory behind the check protocol (see the module doc).

    ``compute_type``: ``float32`` or ``int8`` (weights and activations quantised to 8 bits, declared to the
    noise model in :attr:`internal_formats`); ``hf_model``: the same weights in transformers (or their
    directory), offered as a cross-implementation variant.
    """

    def __init__(self, path, compute_type: str = "float32", hf_model=None) -> None:
        import ctranslate2

        if compute_type not in COMPUTE:
            raise ValueError(f"compute_type: {compute_type!r} is not allowed; allowed: {', '.join(COMPUTE)}")
        self.generator = ctranslate2.Generator(str(path), device="cpu", compute_type=compute_type, intra_threads=1)
        self.internal_formats = dict(COMPUTE[compute_type])
        self.hf_model = hf_model
        self.vocab_size = int(np.asarray(self.generator.forward_batch([[0]])).shape[-1])
        self.prefix: list[int] = []

    def recompute(self, tokens):
        return np.asarray(self.generator.forward_batch([[int(t) for t in tokens]]))[0]

    def prefill(self, tokens):
        self.prefix = [int(t) for t in tokens]
        return self.recompute(tokens)

    def decode(self, token):
        self.prefix.append(int(token))
        words = [[f"t{t}" for t in self.prefix]]
        result = self.generator.generate_batch(
            words, max_length=1, sampling_topk=1, return_logits_vocab=True, include_prompt_in_result=False
        )
        return np.asarray(result[0].logits[0])[0]

    def recompute_variants(self, tokens):
        if self.hf_model is None:
            return {}
        import torch
        from transformers import AutoModelForCausalLM

        if isinstance(self.hf_model, str | Path):
            self.hf_model = AutoModelForCausalLM.from_pretrained(str(self.hf_model), dtype=torch.float32).eval()
        with torch.no_grad():
            ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))[None]
            return {"transformers": self.hf_model(input_ids=ids, use_cache=False).logits[0].numpy()}


def convert(hf_dir, out, quantization: str = "float32") -> Path:
    """``hf_dir`` (a transformers Llama with its tokenizer) converted by CTranslate2's own converter to ``out``."""
    from ctranslate2.converters import TransformersConverter

    TransformersConverter(str(hf_dir)).convert(str(out), quantization=quantization, force=True)
    return Path(out)


def main() -> int:
    import kvfast
    from kvfast.testing import tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        tiny_llama(Path(tmp) / "hf", seed=0)
        path = convert(Path(tmp) / "hf", Path(tmp) / "ct2")
        model = CT2Model(path, hf_model=Path(tmp) / "hf")
        report = kvfast.check_cache(model, [3, 4, 5, 6, 7], 16, mode="control")
        print(report.format())
        return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
