"""The tiny transformer, its KV cache, cached decoding and the bug catalogue."""
