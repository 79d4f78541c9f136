"""The standalone reproducer's text (:func:`kvfast.repro.script.render` fills in the ``@NAME@`` fields).

The script never imports kvfast: it builds the model, runs the scenario's cached calls as the model's own
``generate`` makes them (the ``CALLS`` it was measured to need) and one full recompute of the judged sequence,
and compares them step by step against ``THRESHOLD``. Its model builder and cached path are kvfast's own
(:func:`kvfast.check.hf_path.model_from_config` and :class:`kvfast.check.hf_path.CachedPath`, the source
:class:`~kvfast.check.hf.HFModel` runs, carried verbatim: ``@CACHED_PATH@``), answering how ``generate`` calls
the model from ``CALLS``; an injected catalogue bug is kvfast's own mixin, carried verbatim and put in front of
it (``@PATCH@``, :mod:`kvfast.repro.patches`). The sequence judged is the scenario's main one (``PROMPT`` then
``TOKENS``) or, for ``fork-branch``, ``reorder-beam`` and ``padded-row``, its second one (``BRANCH_PROMPT`` then
``BRANCH_TOKENS``).

What a case holds is data in the script, never code: the docstring (with the case's title and the command that
found it) is written as one Python string literal that evaluates to exactly its text
(:func:`kvfast.repro.script.py_text`), every other value as its ``repr``, and the fields are filled in one pass
(a value holding ``@NAME@`` stays as it is).
"""

#: The script's docstring (its fields filled in, then the whole written as one Python string literal).
DOCSTRING = """@TITLE@

A standalone reproducer: it needs only torch and transformers. It builds a tiny random @MODEL_CLASS@ from the
config below (@WEIGHTS_TEXT@), runs the cached path the way `generate` calls the model (@SCENARIO_TEXT@) and the
full recompute of the same tokens (one forward, no cache), and compares their logits step by step (step 0: the
prompt rows; step t: the token fed at decode step t). It exits 1 while some step's largest difference exceeds
its threshold, 0 when the two paths agree within it.

Threshold: @THRESHOLD_ORIGIN@.
Found by: @COMMAND@
"""

TEMPLATE = r'''#!/usr/bin/env python3
@DOCSTRING@

import json
import platform
import sys

import torch
import transformers

MODEL_CLASS = @MODEL_CLASS_REPR@
CONFIG = json.loads(@CONFIG_JSON@)
SEED = @SEED@
WEIGHTS = @WEIGHTS@  # a state dict beside this script, or None: the weights of torch.manual_seed(SEED)
DTYPE = @DTYPE@
PROMOTE = @PROMOTE@  # None, or "float64": the model built in DTYPE (its weights rounded to it), then run in float64
ATTENTION = @ATTENTION@
SCENARIO = @SCENARIO@  # what the cached path does: decode, resume, rollback, fork, reorder or padded
JUDGED = @JUDGED@  # the sequence compared with its recompute: "main" or "branch" (the second branch, beam or row)
PROMPT = @PROMPT@
TOKENS = @TOKENS@  # the token fed at decode step t = 1, 2, ...
SPLIT = @SPLIT@  # resume: the prompt's first chunk is PROMPT[:SPLIT], the second PROMPT[SPLIT:]
DRAFTS = @DRAFTS@  # rollback: before step t the cache takes these draft tokens, then crop() drops them
# fork: the second branch's tokens, decoded from a snapshot after the prompt; reorder: the second beam's prompt and
# tokens; padded: the batch's second row (left-padded where it is the shorter)
BRANCH_PROMPT = @BRANCH_PROMPT@
BRANCH_TOKENS = @BRANCH_TOKENS@
REORDER_AT = @REORDER_AT@  # reorder: the decode steps before which the two beams swap slots (reorder_cache([1, 0]))
# How `generate` calls this model (measured on the transformers release FOUND_ON): the cache argument's name,
# whether the model builds its own cache (or which cache class it is given), whether an attention mask is passed
# (per call kind), position_ids, cache_position, and whether the cache records its past before a rollback.
CALLS = @CALLS@
FOUND_ON = @FOUND_ON@
FOUND_VERSIONS = @FOUND_VERSIONS@  # where kvfast found it
# torch's intra-op threads when kvfast found it: some kernels (Mamba's reference scan among them) add in another
# order with another thread count, which moves a real bug's per-step difference in its third digit.
THREADS = @THREADS@
# The largest |cached - recompute| each step may show (step 0 first); see the docstring for where it comes from.
THRESHOLD = @THRESHOLD@


def build_model():
    """The tiny model: the config's class, random weights from SEED (or WEIGHTS), eval mode, in DTYPE (then
    PROMOTE), built by kvfast's own model_from_config (below)."""
    weights = None
    if WEIGHTS is not None:
        import os

        here = os.path.dirname(os.path.abspath(__file__))
        weights = torch.load(os.path.join(here, WEIGHTS), weights_only=True)
    return model_from_config(MODEL_CLASS, CONFIG, SEED, ATTENTION, DTYPE, PROMOTE, weights)


# --- kvfast's model builder, cached path and cache operations (kvfast/check/hf_path.py), carried verbatim -----
@CACHED_PATH@

# --- how `generate` called this model where kvfast found it (CALLS) ------------------------------------------


class GeneratePath(CachedPath):
    """kvfast's CachedPath (above), called as `generate` called this model on FOUND_ON (CALLS)."""

    cache_arg = CALLS["cache_arg"]
    takes_mask = CALLS.get("takes_mask", True)
    takes_position_ids = CALLS.get("takes_position_ids", False)
    takes_cache_position = CALLS["cache_position"]

    def _fresh_cache(self):
        if CALLS["own_cache"] or self.cache_arg == "cache_params":
            return None
        if CALLS.get("cache_class") == "StaticCache":
            return transformers.StaticCache(config=self.model.config, max_cache_len=CALLS["max_cache_len"])
        return new_dynamic_cache(self.model.config)

    def _generate_passes_mask(self, ids, mask):
        return CALLS["mask"]["prefill" if self.length == 0 else "decode" if ids.shape[1] == 1 else "chunk"]

    def _generate_positions(self):
        return CALLS["positions"]

    def _prefill_positions(self):
        return CALLS.get("prefill_positions") or self.prefill_len
@PATCH@

def cached_rows(model):
    """The cached path's logits of the judged sequence: one row per prompt position, then one per decode step."""
    path = GeneratePath(model)
    if SCENARIO == "fork":
        return fork_rows(path)
    if SCENARIO in ("reorder", "padded"):
        return batch_rows(path)
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


def fork_rows(path):
    """Prefill, snapshot; steps 1..h, snapshot; restore the prompt's snapshot and decode BRANCH_TOKENS; restore
    step h's snapshot and decode steps h+1.. (h = len(TOKENS) // 2)."""
    h = len(TOKENS) // 2
    first = path.prefill(PROMPT)
    at_prompt = path.snapshot()
    main = [path.decode(token)[None] for token in TOKENS[:h]]
    at_h = path.snapshot()
    path.restore(at_prompt)
    branch = [path.decode(token)[None] for token in BRANCH_TOKENS]
    path.restore(at_h)
    main += [path.decode(token)[None] for token in TOKENS[h:]]
    return torch.cat([first, *(branch if JUDGED == "branch" else main)])


def batch_rows(path):
    """Two sequences in one batch, fed TOKENS and BRANCH_TOKENS one per step; each one's rows taken from the slot
    that holds it. reorder: two beams (PROMPT twice), reordered by [1, 0] (the beams swap slots) before each step
    of REORDER_AT; padded: PROMPT and BRANCH_PROMPT as one left-padded batch."""
    if SCENARIO == "reorder":
        first, decode = path.prefill_beams(PROMPT, 2), path.decode_beams
    else:
        first, decode = path.prefill_padded([PROMPT, BRANCH_PROMPT]), path.decode_padded
    slot = [0, 1]
    rows = [[first[0]], [first[1]]]
    for t, tokens in enumerate(zip(TOKENS, BRANCH_TOKENS), start=1):
        if t in REORDER_AT:
            path.reorder([1, 0])
            slot = [1 - s for s in slot]
        batch = [0, 0]
        batch[slot[0]], batch[slot[1]] = tokens
        out = decode(batch)
        rows[0].append(out[slot[0]][None])
        rows[1].append(out[slot[1]][None])
    return torch.cat(rows[1 if JUDGED == "branch" else 0])


def main():
    print(f"versions: python {platform.python_version()}, torch {torch.__version__}, "
          f"transformers {transformers.__version__} (found on {FOUND_VERSIONS})")
    print(f"model: {MODEL_CLASS}, {DTYPE}, {ATTENTION} attention; scenario {SCENARIO}; prompt of {len(PROMPT)} "
          f"tokens, {len(TOKENS)} decode steps")
    if PROMOTE is not None:
        print(f"run in {PROMOTE}: the model's weights are {DTYPE}'s, its arithmetic {PROMOTE}'s (in {DTYPE} the "
              f"difference hides in {DTYPE}'s rounding; in {PROMOTE} it stands above it)")
    torch.set_num_threads(THREADS)
    model = build_model()
    prompt, tokens = (BRANCH_PROMPT, BRANCH_TOKENS) if JUDGED == "branch" else (PROMPT, TOKENS)
    if JUDGED == "branch":
        print(f"judged: the {SCENARIO} scenario's second sequence (prompt of {len(prompt)} tokens, {len(tokens)} "
              "decode steps), against its own recompute")
    with torch.no_grad():
        recompute = model(input_ids=torch.tensor([prompt + tokens]), use_cache=False).logits[0]
        cached = cached_rows(model)
    T = len(prompt)
    first_row = SPLIT if SCENARIO == "resume" else 0
    first_unequal, first_bug = None, None
    print(f"{'step':>5} {'position':>9} {'max |cached - recompute|':>25} {'threshold':>11}")
    for t in range(len(tokens) + 1):
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
