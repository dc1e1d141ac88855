"""Warm-up of a compiled denoiser (``triptych.accel.compile``): every graph a mixed load needs, compiled before the worker registers.

The shapes that make dynamo compile a new graph (``accel/compile.py``): one row alone (a size of 1
is specialised, no text mask), several rows with prompts of different lengths (the padding mask),
and TeaCache's sub-batch of one masked row. ``warm_up`` runs each once on the family's
``warmup_conditioning`` (random text embeddings of the right width; no encoder needed), so the
first request pays nothing; the results are thrown away.
"""

from __future__ import annotations

import logging
import time

import torch

from triptych.accel.compile import compile_counts
from triptych.families.base import COND, UNCOND, Family, GenerationParams, Row

logger = logging.getLogger(__name__)


@torch.no_grad()
def warm_up(family: Family) -> dict[str, int] | None:
    """Run the shapes above through ``family``'s transformer; the compile counters after it, or None
    when the family has no warm-up conditioning (it then compiles at its first requests)."""
    if family.requires_image:
        logger.info("%s needs a condition image: it compiles at its first requests", family.name)
        return None
    params = family.resolve(GenerationParams(prompt="warm up", seed=0))
    start = time.perf_counter()
    states = []
    for i, lengths in enumerate(((7, 5), (9, 5))):
        cond = family.warmup_conditioning(params, lengths)
        if cond is None:
            logger.info("%s has no warm-up conditioning: it compiles at its first requests", family.name)
            return None
        states.append(family.prepare(f"warm-up-{i}", params, cond))
    rows = [Row(s, b) for b in (COND, UNCOND) for s in states]
    family.forward(rows[:1])  # one row: size 1, no mask
    family.forward(rows)  # several rows, prompts of different lengths: the padding mask
    from triptych.engine.teacache import has_plan, plan_for

    if has_plan(family):  # TeaCache computes a sub-batch of the rows: one masked row
        plan = plan_for(family)
        plan.blocks(plan.embed(rows), torch.tensor([0]))
    counts = compile_counts()
    logger.info("%s warmed up in %.1f s: %s", family.name, time.perf_counter() - start, counts)
    return counts
