"""The encoder layer's scheduler: one batched vision-tower forward per scheduling step.

The encoder runner hands every new request's images to ``EncoderLayer.add`` (an edit's resized
condition image, a chat's images, in the order the tower will see them) and calls ``step()`` once
per ``execute()``. A step takes images round-robin across the waiting requests within the budget
(``MMCacheConfig.step_images`` images, ``step_vision_tokens`` vision tokens; a request with 8 images
cannot starve the others: its rest waits for the next step; with a time budget, also only the
images whose estimated seconds fit it, the first one always), runs each through the processor (its
tier hits on a repeat), and encodes the embedding misses of all of them as ONE tower forward
(``MMEmbeddingCache.encode``, deduplicated by mm-hash and token count). Every image's entry is then
held for its request until ``release``; the request's own encode or chat finds it there.

A request whose images are all encoded is ``ready``. An image that fails to process is left to the
request's own call (which reports the error the usual way): the layer never fails a request itself.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from diffusers.hooks import HookRegistry

from triptych.mmcache import cache as mm
from triptych.mmcache import processor as mm_processor

logger = logging.getLogger(__name__)


@dataclass
class _Waiting:
    tenant: str
    images: deque = field(default_factory=deque)


class EncoderLayer:
    """Prefetches requests' images into the embedding tier, a budgeted batch per step."""

    def __init__(self, cache: mm.MMEmbeddingCache, visual: torch.nn.Module, image_processor, config):
        self.cache = cache
        self.visual = visual
        self.image_processor = image_processor
        self.step_images = config.step_images
        self.step_tokens = config.step_vision_tokens
        self._waiting: dict[str, _Waiting] = {}  # holder → its images not yet encoded (arrival order)
        self._keys: dict[str, list[str]] = {}  # holder → the mm-hashes of its images taken so far
        self._seconds: dict[str, float] = {}  # holder → wall time of the steps that took its images

    def add(self, holder: str, tenant: str, images: list) -> None:
        """A request (``holder``: its id) starts; its ``images`` are encoded at the next steps."""
        if images:
            self._waiting[holder] = _Waiting(tenant, deque(images))

    def ready(self, holder: str) -> bool:
        return holder not in self._waiting

    def pending(self) -> int:
        """Images waiting for a step."""
        return sum(len(w.images) for w in self._waiting.values())

    def held(self, holder: str) -> list[tuple[str, torch.Tensor]]:
        """The request's images' (mm-hash, stored embedding) pairs this encoder holds now, in the order
        they were taken (what it reports to the head for cross-encoder hits)."""
        pairs = [(key, self.cache.store.held_entry(key, holder)) for key in dict.fromkeys(self._keys.get(holder, ()))]
        return [(key, tensor) for key, tensor in pairs if tensor is not None]

    def seconds(self, holder: str) -> float:
        """The wall time of the steps that took the request's images (each step counts whole for
        every request it served): its vision time here."""
        return self._seconds.get(holder, 0.0)

    def release(self, holder: str) -> None:
        """The request finished, failed or was aborted: it waits for nothing and holds nothing."""
        self._waiting.pop(holder, None)
        self._keys.pop(holder, None)
        self._seconds.pop(holder, None)
        self.cache.release(holder)

    def step(self, budget_s: float | None = None, costs=None, stretch: float = 0.0) -> int:
        """One batched forward over the images this step's budget admits; returns how many it took.
        ``budget_s``: seconds the step may spend, estimated by ``costs`` (a ``chat.budget.StepCosts``:
        its ``vision`` seconds per vision token and, once fitted, per call, which this step's
        forward updates); the first image runs even past it. ``stretch`` > 0: where the first
        image alone is over the budget, the forward holds images up to ``costs.call_allowance``
        (0: that image alone). None: the item budget alone."""
        if not self._waiting:
            return 0
        timed = budget_s is not None and costs is not None
        start = time.perf_counter()
        taken: list[tuple[str, mm.Item]] = []
        tokens = 0
        merge = int(getattr(self.visual, "spatial_merge_size", 1)) ** 2
        full = False
        while not full and any(w.images for w in self._waiting.values()):
            for holder, waiting in list(self._waiting.items()):  # one image per request per round
                if not waiting.images:
                    continue
                item = self._item(holder, waiting)
                if item is None:
                    continue
                n = int(item.grid_row.prod()) // merge
                if timed and not taken and stretch > 0:  # the first image runs past a budget it is over
                    budget_s = costs.call_allowance("vision", budget_s, n, stretch)
                over = timed and costs.estimate("vision", tokens + n) > budget_s
                if taken and (len(taken) >= self.step_images or tokens + n > self.step_tokens or over):
                    full = True
                    break
                waiting.images.popleft()
                taken.append((holder, item))
                self._keys.setdefault(holder, []).append(item.key)
                tokens += n
        for holder in [h for h, w in self._waiting.items() if not w.images]:
            del self._waiting[holder]
        for holder, _ in taken:  # round-robin: who was served this step queues behind the others
            if holder in self._waiting:
                self._waiting[holder] = self._waiting.pop(holder)
        forwards = self.cache.stats.forwards
        if taken:
            run = HookRegistry.check_if_exists_or_initialize(self.visual).get_hook(mm.HOOK_NAME).fn_ref.original_forward
            try:
                with torch.no_grad():
                    self.cache.encode(self.visual, run, [item for _, item in taken], {})
            except Exception as e:  # noqa: BLE001 - each request's own call meets it again and reports it
                logger.warning("batched vision forward of %d images failed: %s", len(taken), e)
        seconds = time.perf_counter() - start
        if costs is not None and self.cache.stats.forwards > forwards:  # the tower ran: what it costs
            costs.observe("vision", tokens, seconds)
        for holder in dict.fromkeys(h for h, _ in taken):
            self._seconds[holder] = self._seconds.get(holder, 0.0) + seconds
        return len(taken)

    def _item(self, holder: str, waiting: _Waiting) -> mm.Item | None:
        """The request's next image as the tower will see it; None (and the request left to its own
        call) when the processor refuses it."""
        try:
            with mm.tenant_scope(waiting.tenant):
                ((pixels, grid),) = mm_processor.process(self.image_processor, [waiting.images[0]])
        except (RuntimeError, ValueError, TypeError, OSError) as e:
            logger.warning("request %s: its image could not be preprocessed here (%s)", holder, e)
            waiting.images.clear()
            return None
        device = next(self.visual.parameters()).device
        pixels = pixels.to(device, self.visual.dtype)  # as get_image_features hands them to the tower
        row = grid[0].to(device)
        return mm.Item(self.cache.key(pixels, row, tenant=waiting.tenant), pixels, row, holder)


def encoder_layer(family) -> EncoderLayer | None:
    """The layer of a loaded encoder family with an mm-hash cache and a processor (else None)."""
    cache = getattr(family, "mm_cache", None)
    processor = getattr(getattr(family, "processor", None), "image_processor", None)
    text_encoder = getattr(getattr(family, "pipe", None), "text_encoder", None)
    visual = mm.vision_encoder(text_encoder) if text_encoder is not None else None
    if cache is None or processor is None or visual is None or not hasattr(family, "vision_images"):
        return None
    return EncoderLayer(cache, visual, processor, family.mm_cache_config)
