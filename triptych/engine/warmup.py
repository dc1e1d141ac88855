"""Warm-up of a compiled denoiser (``triptych.accel.compile``): every graph a mixed load needs, compiled before the worker registers.

The shapes that make dynamo compile a new graph (``accel/compile.py``): one row alone (a size of 1
is specialised, no text mask), several rows with prompts of different lengths (the padding mask),
several rows of one length (no mask), and TeaCache's sub-batches of one and of two masked rows.
(Qwen-Image's compiled block stack, ``fast_stack.py``, gives every call one form of inputs, so these
shapes make two graphs there: one row and several.) ``warm_up`` runs each once on the family's
``warmup_conditioning`` (random text embeddings of the right width; no encoder needed), so the
first request pays nothing; the results are thrown away.

On a multi-rank instance every rank runs it at once through the instance's rows forward
(``worker/ranks/warmup.py``): CFG parallel gives each CFG group a contiguous half of the rows, so
the rows run once more in reverse order and each group computes both halves (cond rows of
different lengths: a mask; uncond rows of one length: none). On one rank that is the same graph.

With LoRA adapters served (``serve --lora``), their per-row hooks break the block graphs around each
hooked layer (``lora/rows.py``), so the warm-up first loads every served adapter that fits the
budget (they stay in memory, counted as loads) and runs the shapes with a row using one and a row
using none, at two batch sizes (dynamo makes a graph dynamic at the second size it sees). An adapter
loaded later at run time that hooks other layers compiles at its first request.

A decoder whose family compiles its VAE decoder (``Family.compile_vae_decoder``) runs
``warm_up_decoder`` before it registers: one decode of random latents at the model's default size.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from triptych.accel.compile import compile_counts
from triptych.families.base import COND, UNCOND, Family, GenerationParams, Row

logger = logging.getLogger(__name__)


@torch.no_grad()
def warm_up(family: Family, forward: Callable[[Sequence[Row]], torch.Tensor] | None = None) -> dict[str, int] | None:
    """Run the shapes above through ``family``'s transformer (``forward``: the rows forward to run
    them through; default ``family.forward``); the compile counters after it, or None when the
    family has no warm-up conditioning (it then compiles at its first requests)."""
    forward = forward or family.forward
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
    forward(rows[:1])  # one row: size 1, no mask
    forward(rows)  # several rows, prompts of different lengths: the padding mask
    forward(rows[::-1])  # the same, each CFG group of a CFG-parallel instance computing the other half
    forward(rows[2:])  # several rows of one length (both uncond): no mask
    adapters = _load_served_adapters(family)
    if adapters:
        spec = ((adapters[0], 1.0),)
        lora_states = [family.prepare("warm-up-lora", params.replace(lora=spec), states[0].cond), states[1]]
        lora_rows = [Row(s, b) for b in (COND, UNCOND) for s in lora_states]
        family.lora.acquire("warm-up-lora", spec)
        try:
            for batch in (lora_rows[:1], lora_rows, lora_rows[:3]):  # size 1, then two sizes: dynamic
                forward(batch)
        finally:
            family.lora.release("warm-up-lora")
    from triptych.families.teacache_check import has_plan

    if has_plan(family):  # TeaCache computes a sub-batch of the rows: one masked row, and two
        plan = family.teacache_plan()
        plan.blocks(plan.embed(rows), torch.tensor([0]))
        plan.blocks(plan.embed(rows), torch.tensor([0, 1]))
    counts = compile_counts()
    if adapters:
        counts = dict(counts, lora_adapters=len(adapters))
    logger.info("%s warmed up in %.1f s: %s", family.name, time.perf_counter() - start, counts)
    return counts


@torch.no_grad()
def warm_up_decoder(family: Family) -> dict[str, int] | None:
    """Decode random latents of the model's default request size once, so a compiled VAE decoder
    (``Family.compile_vae_decoder``) has its graph before the first request; the compile counters
    after it, or None when this family has no decoder warm-up (it then compiles at its first decode).
    Another image size compiles once more (dynamo then makes the decoder's graph dynamic)."""
    params = family.resolve(GenerationParams(prompt="warm up", seed=0))
    latents = family.warmup_latents(params)
    if latents is None or getattr(family.pipe, "vae", None) is None:
        return None
    start = time.perf_counter()
    family.decode(latents, params)
    counts = compile_counts()
    logger.info("%s decoder warmed up in %.1f s: %s", family.name, time.perf_counter() - start, counts)
    return counts


def _load_served_adapters(family: Family) -> list[str]:
    """Load (then release) each adapter the family serves, as far as the budget allows."""
    lora = family.lora
    if lora is None:
        return []
    from triptych.lora.store import LoraBudgetError

    loaded = []
    for name in sorted(lora.paths):
        try:
            lora.acquire("warm-up-lora", ((name, 1.0),))
        except LoraBudgetError:
            logger.info("LoRA %r does not fit the budget beside the others: not warmed up", name)
            continue
        lora.release("warm-up-lora")
        loaded.append(name)
    return loaded
