"""The mm-hash cache: a vision tower's outputs, one entry per image, keyed by a content hash of its input.

An edit request runs Qwen2.5-VL's vision tower once per CFG branch on the same image (diffusers'
``encode_prompt`` is called for the prompt and again for the negative prompt), and the same image
sent again (a second edit, a retry, a chat about it) runs it again. The vision tower is
deterministic and sees each image on its own (its attention is windowed within an image), so its
output for the same input is the same tensor: this cache returns the stored result instead.

The hook splits every call into its images (Qwen2.5-VL's visual takes the images' patches
concatenated and one ``grid_thw`` row per image). An image's key, its mm-hash, is a SHA-256 over
its patches and grid row (dtype, shape and bytes: another resize or processor setting is another
key), the call's simple keyword arguments, the cache's scope (the encoder's
``triptych.core.identity.model_identity``) and the tenant (``tenant_scope``). The misses of a call run as
one forward (a batch of many requests' images from ``mm_layer.EncoderLayer.prefetch``, deduplicated
by key), and each image's slice of the output is stored as a tensor of its own. Calls with other
arguments (tensors in kwargs, lists) bypass the cache.

Entries live in an ``mm_store.EmbeddingStore``: held by the requests using them, evicted only when
nobody holds them and a new one needs the room; a hit hands out the stored tensor (no copy).

Installed with diffusers' hook registry (``install``), like the other accelerations, on the module
whose forward is the vision encoder (``text_encoder.model.visual`` for Qwen2.5-VL).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from dataclasses import dataclass

import msgspec
import torch
from diffusers.hooks import HookRegistry, ModelHook
from transformers.modeling_outputs import BaseModelOutputWithPooling

from triptych.mmcache.config import FLAG_NAMES as FLAG_NAMES
from triptych.mmcache.config import MMCacheConfig as MMCacheConfig
from triptych.mmcache.stats import MMCacheStats
from triptych.mmcache.store import EmbeddingStore

HOOK_NAME = "triptych_mm_cache"
#: The tenant whose request the current encode serves (set by the caller around an encode or a chat,
#: ``tenant_scope``); part of every key, so one tenant's entries never serve another's requests.
TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("triptych_mm_tenant", default="")
#: The request the current encode serves (``holder_scope``): the entries its calls touch are held
#: for it until the encoder runner releases it.
HOLDER: contextvars.ContextVar[str | None] = contextvars.ContextVar("triptych_mm_holder", default=None)
SIMPLE = (type(None), bool, int, float, str)


def content_hash(*tensors: torch.Tensor, extra: str = "") -> str:
    """SHA-256 of each tensor's dtype, shape and bytes (in order), then ``extra``."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    h.update(extra.encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Item:
    """One image for the tower: its mm-hash, patches, ``grid_thw`` row, and the request holding it."""

    key: str
    patches: torch.Tensor
    grid_row: torch.Tensor
    holder: str | None = None


class MMEmbeddingCache:
    """The embedding tier: per-image vision-tower outputs by mm-hash (an ``EmbeddingStore``)."""

    def __init__(self, max_bytes: int = 256 << 20, scope: str = "", processor=None, shared=None):
        """``scope`` goes into every key: the encoder's identity (model revision); the tenant of the
        request (``tenant_scope``) joins it per lookup. ``processor``: the processor tier
        (``mmcache.processor.ProcessorCache``, installed on the image processor), if any; ``shared``:
        the host's shared store (``mmcache.shared.SharedStore``), if configured."""
        self.stats = MMCacheStats()
        self.store = EmbeddingStore(max_bytes, self.stats)
        self.scope = scope
        self.processor = processor
        self.shared = shared
        #: another encoder's entries, fetched on a miss (``worker.mm_remote.RemoteEmbeddings``): its
        #: ``fetch(key, tokens)`` gives the tensor or None; None: this cache asks no peer
        self.remote = None

    def connect_remote(self, remote) -> None:
        """Fetch misses from other encoders through ``remote`` (``worker.mm_remote.attach``). The one
        link made after construction: ``remote`` lends from this cache, so it is built on it."""
        self.remote = remote

    def __len__(self) -> int:
        return len(self.store)

    @property
    def nbytes(self) -> int:
        return self.store.nbytes

    @property
    def max_bytes(self) -> int:
        return self.store.max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int) -> None:
        self.store.max_bytes = value

    def key(self, patches: torch.Tensor, grid_row: torch.Tensor, extra: str = "[]", tenant: str | None = None) -> str:
        """One image's mm-hash: its patches and grid row, the scope, the tenant (``tenant_scope``'s
        unless given), the call's settings (``extra``: its simple keyword arguments; none = "[]")."""
        tenant = TENANT.get() if tenant is None else tenant
        return content_hash(patches, grid_row, extra=f"{self.scope}|tenant={tenant}|{extra}")

    def release(self, holder: str) -> None:
        self.store.release(holder)

    def encode(self, module: torch.nn.Module, run, items: list[Item], kwargs: dict) -> list[torch.Tensor]:
        """Each item's embedding: hits from the store, the misses in ONE forward of ``run`` (the
        tower's own forward), deduplicated by (mm-hash, token count), each stored on its own."""
        merge = int(getattr(module, "spatial_merge_size", 1)) ** 2
        tokens = [int(item.grid_row.prod()) // merge for item in items]
        found: dict[tuple[str, int], torch.Tensor] = {}
        todo: list[int] = []
        for i, (item, n) in enumerate(zip(items, tokens)):
            if (item.key, n) in found or any((items[j].key, tokens[j]) == (item.key, n) for j in todo):
                continue
            hit = self.store.get(item.key, n, item.holder)
            if hit is None:
                todo.append(i)
            else:
                found[item.key, n] = hit
        # before the tower: the encoder the head named as holding it, then this host's shared directory
        sources = [x for x in (self.remote and self.remote.fetch, self.shared and self.shared.load) if x]
        for source in sources:
            for i in list(todo):
                got = source(items[i].key, tokens[i])
                if got is not None:
                    got = got.to(items[i].patches.device)
                    found[items[i].key, tokens[i]] = self.store.put(items[i].key, got, items[i].holder)
                    todo.remove(i)
        if todo:
            out = run(
                torch.cat([items[i].patches for i in todo]), torch.stack([items[i].grid_row for i in todo]), **kwargs
            )
            self.stats.forwards += 1
            merged = out["pooler_output"] if isinstance(out, dict) else out[1]
            want = sum(tokens[i] for i in todo)
            if merged.shape[0] != want:
                raise ValueError(f"the vision tower returned {merged.shape[0]} embeddings for {want} image tokens")
            for i, piece in zip(todo, torch.split(merged, [tokens[i] for i in todo])):
                found[items[i].key, tokens[i]] = self.store.put(items[i].key, piece, items[i].holder)
                if self.shared is not None:
                    self.shared.save(items[i].key, found[items[i].key, tokens[i]])
        for item in items:  # the batch's duplicates are held for their own requests
            if item.holder is not None:
                self.store.acquire(item.key, item.holder)
        return [found[item.key, n] for item, n in zip(items, tokens)]

    def snapshot(self) -> MMCacheStats:
        """The counters so far and the sizes now (a copy: lookups keep counting into ``stats``)."""
        with self.store.lock:
            snap = msgspec.structs.replace(
                self.stats, entries=len(self.store), nbytes=self.store.nbytes, held=self.store.held()
            )
        if self.processor is not None:
            snap = msgspec.structs.replace(snap, processor=self.processor.snapshot())
        if self.shared is not None:
            snap = msgspec.structs.replace(snap, shared=self.shared.snapshot())
        if self.remote is not None:
            snap = msgspec.structs.replace(snap, remote=self.remote.snapshot())
        return snap


class _EncoderCacheHook(ModelHook):
    def __init__(self, cache: MMEmbeddingCache):
        super().__init__()
        self.cache = cache

    def new_forward(self, module: torch.nn.Module, *args, **kwargs):
        run = self.fn_ref.original_forward
        split = _split_call(args, kwargs)
        if split is None:
            self.cache.stats.bypassed += 1
            self.cache.stats.forwards += 1
            return run(*args, **kwargs)
        pixels, grid, extra = split
        holder = HOLDER.get()
        items, start = [], 0
        for row in grid:
            n = int(row.prod())
            patches = pixels[start : start + n]
            items.append(Item(self.cache.key(patches, row, extra), patches, row, holder))
            start += n
        rest = {k: v for k, v in kwargs.items() if k not in ("hidden_states", "grid_thw")}
        embeds = self.cache.encode(module, run, items, rest)
        pooled = embeds[0] if len(embeds) == 1 else torch.cat(embeds)
        # A fresh container per call (its consumer, get_image_features, replaces pooler_output in it);
        # last_hidden_state, the unmerged per-patch states, is read by no consumer and not kept.
        return BaseModelOutputWithPooling(last_hidden_state=None, pooler_output=pooled)


#: Keyword arguments left out of the key. ``output_hidden_states`` reaches Qwen2.5-VL's vision tower
#: only because the caller asked the *language model* for its hidden states (QwenImage's prompt
#: encoding does; ``generate`` for chat does not); it adds the tower's per-block states to the output
#: and changes nothing else. Left out, an edit encode and a chat about the same image share one entry.
UNKEYED = ("output_hidden_states", "return_dict")


def _split_call(args, kwargs) -> tuple[torch.Tensor, torch.Tensor, str] | None:
    """(patches, grid_thw, the key's settings) of a ``visual(hidden_states, grid_thw, **simple)``
    call, or None for a call this cache cannot key."""
    kwargs = dict(kwargs)
    pixels = args[0] if args else kwargs.pop("hidden_states", None)
    grid = args[1] if len(args) > 1 else kwargs.pop("grid_thw", None)
    if len(args) > 2 or not isinstance(pixels, torch.Tensor) or not isinstance(grid, torch.Tensor):
        return None
    if grid.ndim != 2 or grid.shape[1] != 3 or int(grid.prod(-1).sum()) != pixels.shape[0]:
        return None
    simple = {k: v for k, v in kwargs.items() if k not in UNKEYED}
    if any(not isinstance(v, SIMPLE) for v in simple.values()):
        return None
    return pixels, grid, repr(sorted(simple.items()))


def check_placeholders(placeholders: int, embeds: torch.Tensor) -> torch.Tensor:
    """``embeds`` (the images' embeddings, concatenated) when their rows match the prompt's image
    placeholder tokens; a clear error naming both counts otherwise (for an engine that scatters the
    layer's embeddings into a prompt itself; transformers' own forward checks the same)."""
    if embeds.shape[0] != placeholders:
        raise ValueError(
            f"the prompt has {placeholders} image placeholder tokens but its images' embeddings have "
            f"{embeds.shape[0]} rows: the prompt and the images were processed with different settings"
        )
    return embeds


@contextlib.contextmanager
def tenant_scope(tenant: str):
    """Key the mm-hash cache lookups made inside this block by ``tenant`` ("" = the shared scope)."""
    token = TENANT.set(tenant)
    try:
        yield
    finally:
        TENANT.reset(token)


@contextlib.contextmanager
def holder_scope(holder: str | None):
    """The entries touched inside this block are held for ``holder`` (a request id) until released."""
    token = HOLDER.set(holder)
    try:
        yield
    finally:
        HOLDER.reset(token)


def install(module: torch.nn.Module, cache: MMEmbeddingCache) -> MMEmbeddingCache:
    """Serve ``module``'s forward from ``cache`` (one registration per module; returns the cache)."""
    registry = HookRegistry.check_if_exists_or_initialize(module)
    if registry.get_hook(HOOK_NAME) is not None:
        registry.remove_hook(HOOK_NAME, recurse=False)
    registry.register_hook(_EncoderCacheHook(cache), HOOK_NAME)
    return cache


def vision_encoder(text_encoder: torch.nn.Module) -> torch.nn.Module | None:
    """The vision tower of a transformers VLM (Qwen2.5-VL: ``.model.visual``), or None."""
    for owner in (getattr(text_encoder, "model", None), text_encoder):
        visual = getattr(owner, "visual", None)
        if isinstance(visual, torch.nn.Module):
            return visual
    return None
