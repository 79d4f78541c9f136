"""The standalone reproducer's text (:func:`kvfast.repro.script.render` fills in the ``@NAME@`` fields).

The script never imports kvfast: it builds the model, runs the scenario's cached calls as the model's own
``generate`` makes them (the ``CALLS`` it was measured to need) and one full recompute, and compares them step by
step against ``THRESHOLD``. Its ``CachedPath`` mirrors :class:`kvfast.check.hf.HFModel`'s cached calls; an
injected catalogue bug is a subclass of it placed after it (:mod:`kvfast.repro.patches`).
"""

TEMPLATE = r'''#!/usr/bin/env python3
"""@TITLE@

A standalone reproducer: it needs only torch and transformers. It builds a tiny random @MODEL_CLASS@ from the
config below (@WEIGHTS_TEXT@), runs the cached path the way `generate` calls the model (@SCENARIO_TEXT@) and the
full recompute of the same tokens (one forward, no cache), and compares their logits step by step (step 0: the
prompt rows; step t: the token fed at decode step t). It exits 1 while some step's largest difference exceeds
its threshold, 0 when the two paths agree within it.

Threshold: @THRESHOLD_ORIGIN@.
Found by: @COMMAND@
"""

import json
import platform
import sys

import torch
import transformers

MODEL_CLASS = @MODEL_CLASS_REPR@
CONFIG = json.loads(r"""@CONFIG_JSON@""")
SEED = @SEED@
WEIGHTS = @WEIGHTS@  # a state dict beside this script, or None: the weights of torch.manual_seed(SEED)
DTYPE = @DTYPE@
ATTENTION = @ATTENTION@
SCENARIO = @SCENARIO@
PROMPT = @PROMPT@
TOKENS = @TOKENS@  # the token fed at decode step t = 1, 2, ...
SPLIT = @SPLIT@  # resume: the prompt's first chunk is PROMPT[:SPLIT], the second PROMPT[SPLIT:]
DRAFTS = @DRAFTS@  # rollback: before step t the cache takes these draft tokens, then crop() drops them
# How `generate` calls this model (measured on transformers @FOUND_ON@): the cache argument's name, whether the
# model builds its own cache, whether an attention mask is passed (per call kind), position_ids, cache_position,
# and whether the cache records its past before a rollback (activate_past_recording).
CALLS = @CALLS@
# The largest |cached - recompute| each step may show (step 0 first); see the docstring for where it comes from.
THRESHOLD = @THRESHOLD@


def build_model():
    """The tiny model: the config's class, random weights from SEED (or WEIGHTS), eval mode, in DTYPE."""
    config = transformers.AutoConfig.for_model(**CONFIG)
    if SEED is not None:
        torch.manual_seed(SEED)
    model = getattr(transformers, MODEL_CLASS)._from_config(config, attn_implementation=ATTENTION)
    if WEIGHTS is not None:
        import os

        here = os.path.dirname(os.path.abspath(__file__))
        model.load_state_dict(torch.load(os.path.join(here, WEIGHTS), weights_only=True))
    if not isinstance(getattr(model.config, "vocab_size", None), int):
        model.config.vocab_size = model.config.get_text_config().vocab_size
    return model.eval().to(getattr(torch, DTYPE))


class CachedPath:
    """The cached calls as `generate` makes them: a fresh DynamicCache (or the model's own cache), an all-ones
    attention mask over every position so far where `generate` passes one, position_ids after the cache."""

    def __init__(self, model):
        self.model = model
        self.cache, self.length, self.prefill_len, self.decoded, self.last_token = None, 0, 0, 0, None

    def fresh_cache(self):
        if CALLS["own_cache"] or CALLS["cache_arg"] == "cache_params":
            return None
        try:
            return transformers.DynamicCache(config=self.model.config)
        except TypeError:  # transformers 4.x: no config argument
            return transformers.DynamicCache()

    def wrap_cache(self):
        """Called on every fresh cache (where an injected bug wraps it)."""

    def attention_mask(self, n):
        return torch.ones(1, self.length + n, dtype=torch.long)

    def decode_positions(self):
        """The decoded token's position_ids (None: generate's, the positions after the cache)."""
        return None

    def crop_keep(self, n, length):
        return n

    def cached_forward(self, **kwargs):
        with torch.no_grad():
            return self.model(**kwargs)

    def forward(self, tokens, positions=None):
        n = len(tokens)
        kind = "prefill" if self.length == 0 else "decode" if n == 1 else "chunk"
        kwargs = {"input_ids": torch.tensor([tokens]), "use_cache": True, CALLS["cache_arg"]: self.cache}
        if CALLS["mask"][kind]:
            kwargs["attention_mask"] = self.attention_mask(n)
        if CALLS["cache_position"]:
            kwargs["cache_position"] = torch.arange(self.length, self.length + n)
        if positions is None and CALLS["positions"]:
            positions = list(range(self.length, self.length + n))
        if positions is not None:
            kwargs["position_ids"] = torch.tensor([positions])
        out = self.cached_forward(**kwargs)
        self.cache = next(out[k] for k in ("cache", "past_key_values", "cache_params") if k in out.keys())
        self.length += n
        self.last_token = tokens[-1]
        return out.logits[0]

    def prefill(self, tokens):
        self.cache, self.length, self.decoded = self.fresh_cache(), 0, 0
        if self.cache is not None:
            self.wrap_cache()
        out = self.forward(tokens)
        self.prefill_len = self.length
        return out

    def extend(self, tokens):
        if CALLS["cache_arg"] == "cache_params":  # generate feeds these models one token per call
            return torch.cat([self.forward([t]) for t in tokens])
        return self.forward(tokens)

    def decode(self, token):
        positions = self.decode_positions()
        self.decoded += 1
        return self.forward([token], positions)[0]

    def crop(self, n):
        """Keep the first n positions (a rollback): cache.crop(-r) removes r positions in every release."""
        if CALLS["record_past"] and callable(getattr(self.cache, "activate_past_recording", None)):
            self.cache.activate_past_recording()
        n = self.crop_keep(n, self.length)
        if self.length > n:
            self.cache.crop(n - self.length)
        self.length = n
        self.decoded = max(0, n - self.prefill_len)
@PATCH@

def cached_rows(model):
    """The cached path's logits: one row per prompt position, then one per decode step."""
    path = CachedPath(model)
    if SCENARIO == "resume":
        prompt = torch.cat([path.prefill(PROMPT[:SPLIT]), path.extend(PROMPT[SPLIT:])])
    else:
        prompt = path.prefill(PROMPT)
    if SCENARIO == "rollback":
        path.crop(len(PROMPT))  # a rollback of nothing, where the cache starts recording its past
    rows = [prompt]
    for t, token in enumerate(TOKENS, start=1):
        if SCENARIO == "rollback" and t in DRAFTS:
            for draft in DRAFTS[t]:
                path.decode(draft)
            path.crop(len(PROMPT) + t - 1)
        rows.append(path.decode(token)[None])
    return torch.cat(rows)


def main():
    print(f"versions: python {platform.python_version()}, torch {torch.__version__}, "
          f"transformers {transformers.__version__} (found on @FOUND_VERSIONS@)")
    print(f"model: {MODEL_CLASS}, {DTYPE}, {ATTENTION} attention; scenario {SCENARIO}; prompt of {len(PROMPT)} "
          f"tokens, {len(TOKENS)} decode steps")
    model = build_model()
    with torch.no_grad():
        recompute = model(input_ids=torch.tensor([PROMPT + TOKENS]), use_cache=False).logits[0]
    cached = cached_rows(model)
    T = len(PROMPT)
    first_row = SPLIT if SCENARIO == "resume" else 0
    first_unequal, first_bug = None, None
    print(f"{'step':>5} {'position':>9} {'max |cached - recompute|':>25} {'threshold':>11}")
    for t in range(len(TOKENS) + 1):
        rows = slice(first_row, T) if t == 0 else slice(T + t - 1, T + t)
        diff = float((cached[rows].double() - recompute[rows].double()).abs().max())
        where = f"{first_row}-{T - 1}" if t == 0 else str(T + t - 1)
        flag = "  <- exceeds" if diff > THRESHOLD[t] else ""
        print(f"{t:>5} {where:>9} {diff:>25.6g} {THRESHOLD[t]:>11.3g}{flag}")
        if diff != 0 and first_unequal is None:
            first_unequal = t
        if diff > THRESHOLD[t] and first_bug is None:
            first_bug = (t, where, diff, cached[rows].double(), recompute[rows].double())
    print(f"first step where the two paths are not bit-equal: {first_unequal}")
    if first_bug is None:
        print("the cached path agrees with the recompute within the threshold at every step: no bug shown")
        return 0
    t, where, diff, a, b = first_bug
    print(f"first differing step: {t} (position {where}): largest |cached - recompute| {diff:.6g} > threshold "
          f"{THRESHOLD[t]:.3g}; cached rows' largest |logit| {float(a.abs().max()):.6g}, recompute rows' "
          f"{float(b.abs().max()):.6g}; argmax {a.argmax(-1).tolist()} vs {b.argmax(-1).tolist()}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
'''
