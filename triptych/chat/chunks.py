"""Which prompt chunks a chat engine step prefills while chats decode: by item counts, or by the
estimated time of their vision encode and prefill (``StepCosts``).

Both take the prefilling chats in admission order (anything with ``prompt``, ``prefilled`` and
``features``: ``engine.Chat``) and return ``(chat, end)`` pairs: each chat's chunk is
``prompt[prefilled:end]``. An image's vision tower runs in the chunk that first touches its tokens.

Progress (no starvation): the first prefilling chat always gets a chunk. By time, that chunk holds
at least its next *unit*, even past the budget: the whole next image (its tower and its tokens),
or at least ``min(text_least, tokens up to the next image)`` text tokens. A prompt with ``n``
images and ``t`` text tokens (``n + 1`` text runs at most) so finishes its prefill within
``2 * n + 1 + ceil(t / text_least)`` steps of becoming the first prefilling chat; the chats behind
it wait only for those ahead of them, each bounded the same way.

By time, the tower runs of a step are one call (``tower_batch``): the images its chunks touch,
and where those are over the budget (the call runs past it anyway), the next images waiting in
the prefilling chats, within ``StepCosts.call_allowance``; their tokens prefill in later chunks,
priced as prefill alone.

With the engine's vision thread a chat may have a tower call in flight (``towers``: its image
indices): a chunk stops before such an image, so the first chat whose next unit is ready is the
one that progresses, and a chat blocked on the tower progresses once its call is in (the calls
finish in admission order)."""

from __future__ import annotations

import math


def item_chunks(prefilling: list, tokens: int, images: int) -> list[tuple[object, int]]:
    """At most ``tokens`` prompt tokens and ``images`` vision-tower runs in all (a chunk stops before
    an image past the image count); the first chat always gets a chunk."""
    chunks = []
    for chat in prefilling:
        if tokens <= 0:
            break
        start = chat.prefilled
        end = start + min(len(chat.prompt) - start, tokens)
        for j, (t0, t1, _, _) in enumerate(chat.prompt.images):  # images whose tower runs in this chunk
            if t1 <= start or t0 >= end or j in chat.features:
                continue
            if in_tower(chat, j):
                end = t0  # its embeddings are still on the vision thread
                break
            if images == 0:
                end = t0  # the chunk stops before it: its tower runs in a later step
                break
            images -= 1
        if end > start:
            chunks.append((chat, end))
            tokens -= end - start
    return chunks


def timed_chunks(prefilling: list, budget_s: float, costs, text_least: int) -> list[tuple[object, int]]:
    """Units (an image with its tokens, or a run of text tokens) in admission order while their
    estimated seconds fit ``budget_s``; the first chat's first unit runs even past it (alone when
    it alone is over budget). A chat's chunk ends at the first unit that does not fit, so its
    chunks stay in prompt order."""
    chunks = []
    for chat in prefilling:
        start = end = chat.prefilled
        while end < len(chat.prompt) and not unit_in_tower(chat, end):
            first = not chunks and end == start
            unit_end, cost = next_unit(chat, end, budget_s, costs, text_least if first else 0)
            if cost > budget_s and not first:
                break
            budget_s -= cost
            end = unit_end
        if end > start:
            chunks.append((chat, end))
        if budget_s <= 0:
            break
    return chunks


def next_unit(chat, at: int, budget_s: float, costs, least: int) -> tuple[int, float]:
    """The end of the chat's next unit from token ``at`` and its estimated seconds. Inside or at an
    image: to the image's end (its tower, unless already run for this prompt, and its tokens'
    prefill). Text: as many tokens up to the next image as ``budget_s`` pays for, at least
    ``least`` (and at least one, reported over budget when it does not fit)."""
    prompt = chat.prompt
    next_image = len(prompt)
    for j, (t0, t1, _, _) in enumerate(prompt.images):
        if t0 <= at < t1:
            vision = 0.0 if j in chat.features else costs.estimate("vision", t1 - t0)
            return t1, vision + costs.estimate("prefill", t1 - at)
        if t0 > at:
            next_image = min(next_image, t0)
    run = next_image - at
    per = costs.estimate("prefill", 1)
    if per == 0:
        affordable = run
    elif math.isfinite(per) and budget_s > 0:
        affordable = min(run, math.floor(budget_s / per))
    else:
        affordable = 0
    n = max(affordable, min(run, least), 1)
    return at + n, costs.estimate("prefill", n)


def in_tower(chat, j: int) -> bool:
    """Whether image ``j`` of the chat's prompt is in a tower call still in flight."""
    towers = getattr(chat, "towers", None)
    return towers is not None and j in towers.images and j not in chat.features


def unit_in_tower(chat, at: int) -> bool:
    """Whether the unit from token ``at`` is an image whose tower call is still in flight."""
    return any(t0 <= at < t1 and in_tower(chat, j) for j, (t0, t1, _, _) in enumerate(chat.prompt.images))


def tower_batch(prefilling: list, chunks: list, costs, budget_s: float, stretch: float) -> list[tuple[object, int]]:
    """``(chat, image index)`` pairs whose tower runs in this step, as ONE call: the images the
    chunks touch with no embeddings yet, then, where those are estimated over ``budget_s`` (the
    step runs past it anyway), the next images of the prefilling chats without embeddings, in
    admission and prompt order, of the first one's tenant, while the call's estimate fits
    ``costs.call_allowance`` (``stretch`` 0: only the touched images)."""
    batch = []
    for chat, end in chunks:
        for j, (t0, t1, _, _) in enumerate(chat.prompt.images):
            if t1 > chat.prefilled and t0 < end and j not in chat.features and not in_tower(chat, j):
                batch.append((chat, j))
    if not batch or stretch <= 0:
        return batch
    tokens = sum(c.prompt.images[j][1] - c.prompt.images[j][0] for c, j in batch)
    allowance = costs.call_allowance("vision", budget_s, tokens, stretch)
    if allowance <= budget_s:  # the touched images fit the budget: the chunks' own pricing holds
        return batch
    tenant = _tenant(batch[0][0])
    chosen = {(id(c), j) for c, j in batch}
    for chat in prefilling:
        if _tenant(chat) != tenant:
            continue
        for j, (t0, t1, _, _) in enumerate(chat.prompt.images):
            if t1 <= chat.prefilled or j in chat.features or in_tower(chat, j) or (id(chat), j) in chosen:
                continue
            if costs.estimate("vision", tokens + t1 - t0) > allowance:
                return batch
            batch.append((chat, j))
            tokens += t1 - t0
    return batch


def _tenant(chat) -> str:
    params = getattr(chat, "params", None)
    return getattr(params, "tenant", "")
