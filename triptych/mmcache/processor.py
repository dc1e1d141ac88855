"""The processor tier: an image processor's outputs (pixel patches, patch grid) by the image's bytes.

Qwen2.5-VL's image processor resizes, rescales, normalises and patchifies each image on its own and
concatenates the results; a repeated image (the second CFG branch of an edit, a follow-up question
in a chat, the same picture in another request) gets its stored ``pixel_values`` rows and
``image_grid_thw`` row back instead. The key is a SHA-256 of the decoded image (mode, size, pixels:
the same pixels under two file names are one entry, other pixels under one name another), the
processor's settings (``to_dict()``: min/max pixels, patch and merge size, mean/std...) and the
call's keyword arguments, and the tenant (``mm.TENANT``). Images that are not PIL images, or calls
with other arguments, run as they are (``bypassed``).

Installed on the image processor instance's ``preprocess`` (what its ``__call__`` runs).
Entries are LRU by bytes (a ``cachetools.LRUCache`` sized by each entry's bytes: nothing holds a
processor entry past the call that reads it, so any entry may go); a hit returns the stored tensors
(read-only by contract: the processor's consumers only concatenate and move them).
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref

import msgspec
import torch
from cachetools import LRUCache
from transformers import BatchFeature

from triptych.mmcache import cache as mm
from triptych.mmcache.stats import TierStats


def image_hash(image) -> str | None:
    """SHA-256 of a PIL image's mode, size and pixel bytes (None for anything else)."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        return None
    h = hashlib.sha256(f"{image.mode}|{image.size}|".encode())
    h.update(image.tobytes())
    return h.hexdigest()


class _Entries(LRUCache):
    """(pixel_values rows, image_grid_thw row, bytes) by key, least recently used evicted first."""

    def __init__(self, max_bytes: int, stats: TierStats):
        super().__init__(max_bytes, getsizeof=lambda entry: entry[2])
        self.stats = stats

    def popitem(self):
        self.stats.evictions += 1
        return super().popitem()


class ProcessorCache:
    """image key → (pixel_values rows, image_grid_thw row), LRU within ``max_bytes``."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes}: must be >= 0 (0 disables the tier)")
        self.max_bytes = max_bytes
        self.stats = TierStats()
        self.bypassed = 0
        self._entries = _Entries(max_bytes, self.stats)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return int(self._entries.currsize)

    def snapshot(self) -> TierStats:
        with self._lock:
            return msgspec.structs.replace(self.stats, entries=len(self._entries), nbytes=self.nbytes)

    def get(self, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        with self._lock:
            found = self._entries.get(key)  # a hit is the most recently used entry now
            if found is None:
                self.stats.misses += 1
                return None
            self.stats.hits += 1
            return found[0], found[1]

    def put(self, key: str, pixels: torch.Tensor, grid: torch.Tensor) -> None:
        size = pixels.numel() * pixels.element_size() + grid.numel() * grid.element_size()
        with self._lock:
            if key in self._entries:
                return
            if size > self.max_bytes:
                self.stats.not_stored += 1
                return
            self._entries[key] = (pixels.contiguous().clone(), grid.contiguous().clone(), size)  # evicts LRU first


def settings_of(image_processor) -> str:
    """The processor's settings as canonical JSON (its ``to_dict()``)."""
    return json.dumps(image_processor.to_dict(), sort_keys=True, default=repr)


#: image processor → its cache (the processor's own attributes stay as they were: it still saves,
#: prints and compares as before).
_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cache_of(image_processor) -> ProcessorCache | None:
    return _CACHES.get(image_processor)


def install(image_processor, cache: ProcessorCache) -> ProcessorCache:
    """Serve ``image_processor``'s calls image by image from ``cache`` (one cache per instance: the
    instance's class becomes a subclass of the same name whose ``preprocess`` looks up first)."""
    if image_processor not in _CACHES:
        base = type(image_processor)
        image_processor.__class__ = type(base.__name__, (base,), {"preprocess": _cached_preprocess})
    _CACHES[image_processor] = cache
    return cache


def _cached_preprocess(self, images, *args, **kwargs):
    original = super(type(self), self).preprocess
    cache = _CACHES.get(self)
    simple = all(isinstance(v, mm.SIMPLE) for v in kwargs.values())
    if cache is None or args or kwargs.get("return_tensors") != "pt" or not simple:
        if cache is not None:
            cache.bypassed += 1
        return original(images, *args, **kwargs)
    items = list(images) if isinstance(images, (list, tuple)) else [images]
    hashes = [image_hash(im) for im in items]
    if not items or None in hashes:
        cache.bypassed += 1
        return original(images, *args, **kwargs)
    extra = f"{settings_of(self)}|{sorted(kwargs.items())!r}|tenant={mm.TENANT.get()}"
    parts = []
    for image, h in zip(items, hashes):
        key = hashlib.sha256(f"{h}|{extra}".encode()).hexdigest()
        hit = cache.get(key)
        if hit is None:
            out = original(image, **kwargs)
            hit = (out["pixel_values"], out["image_grid_thw"])
            cache.put(key, *hit)
        parts.append(hit)
    pixels = parts[0][0] if len(parts) == 1 else torch.cat([p for p, _ in parts])
    grid = parts[0][1] if len(parts) == 1 else torch.cat([g for _, g in parts])
    return BatchFeature(data={"pixel_values": pixels, "image_grid_thw": grid})


def process(image_processor, images: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each image's (pixel_values, image_grid_thw) as the processor gives them inside a chat or an
    edit (``return_tensors="pt"``), through its cache when it has one."""
    return [
        (out["pixel_values"], out["image_grid_thw"])
        for out in (image_processor(image, return_tensors="pt") for image in images)
    ]
