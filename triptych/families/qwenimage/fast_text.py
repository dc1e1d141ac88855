"""A step batch's text stream input on Qwen-Image's fast path (``fast.py``), kept while the batch stays.

A forward of several requests' rows pads their prompt embeddings into one batch and projects it
(``txt_in(txt_norm(.))``), as the model's forward does for those rows. A step batch keeps its
composition for many steps, so the result is kept on the batch's first request
(``QwenTables.batch``, freed with that request) and reused while the rows' prompt tensors are the
same objects (weak references: a freed prompt is a miss, and a new tensor is never taken for it) and
the two layers' weights the same tensors at the same versions; not kept when either layer has a hook
other than the idle ones (a hook runs at every call). Its gain is in benchmarks/RESULTS.md
("Where a compiled step's time goes"); the same bits (tests/pipelines/test_step_tables.py).
"""

from __future__ import annotations

import weakref

import torch

from triptych.families.qwenimage.denoise import pad_prompts
from triptych.families.qwenimage.fast_watch import hooked


def batch_text(transformer, tables, prompts: list[torch.Tensor], idle: frozenset[int]) -> tuple:
    """(text, bool mask or None for equal lengths) of ``prompts`` padded as one batch; ``tables``: the
    batch's first request's ``QwenTables``, which keeps it; ``idle``: the hooks that add nothing."""
    t = transformer
    weights = tuple((w, w._version) for w in (*t.txt_in.parameters(), *t.txt_norm.parameters()))
    keep = not (hooked(t.txt_in, idle) or hooked(t.txt_norm, idle))
    kept = tables.batch
    if (
        keep
        and kept is not None
        and len(kept[0]) == len(prompts)
        and all(ref() is p for ref, p in zip(kept[0], prompts))
        and len(kept[1]) == len(weights)
        and all(a is b and v == u for (a, v), (b, u) in zip(kept[1], weights))
    ):
        return kept[2], kept[3]
    embeds, mask = pad_prompts(prompts)
    txt = t.txt_in(t.txt_norm(embeds))
    mask = mask.to(torch.bool) if mask is not None else None
    tables.batch = (tuple(weakref.ref(p) for p in prompts), weights, txt, mask) if keep else None
    return txt, mask
