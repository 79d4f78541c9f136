"""The tiny random Llama every engine's test model is converted from (transformers weights and a word-level
tokenizer in one directory; no download): :func:`tiny_llama`."""

from __future__ import annotations

from pathlib import Path

from kvfast.validation import require_int

#: The tiny Llama's shape. No linear layer has as many outputs as the vocabulary: onnxruntime-genai 0.18's
#: builder takes any such layer for the language-model head (an MLP width of 128 = the vocabulary wired the head
#: to layer 0's MLP input; a hidden size of 128 to an attention projection). Head size 32: llama.cpp's q8_0 KV
#: cache stores blocks of 32.
TINY_LLAMA = dict(
    vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=1,
)  # fmt: skip


def tiny_llama(out, seed: int = 0):
    """Write a tiny random Llama (:data:`TINY_LLAMA`; norm weights drawn too, so no two norms are alike) and a
    word-level tokenizer (``t0`` ... ``t255``) to the directory ``out``; return the model (float32, eval)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    seed = require_int(seed, "seed", 0)
    out = Path(out)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
    model.save_pretrained(out)
    vocab = TINY_LLAMA["vocab_size"]
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t2"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, bos_token="t0", eos_token="t1", pad_token="t1", unk_token="t2"
    ).save_pretrained(out)
    return model
