"""The mm-hash cache: a vision encoder's outputs keyed by a content hash of its exact input.

An edit request runs Qwen2.5-VL's vision tower once per CFG branch on the same image (diffusers'
``encode_prompt`` is called for the prompt and again for the negative prompt), and the same image
sent again (a second edit, a retry, later a chat turn about it) runs it again. The vision tower is
deterministic, so its output for the same input tensor is the same tensor: this cache returns the
stored result instead, which is exact, not an approximation.

The key is a SHA-256 over the input tensors' dtype, shape and bytes (the preprocessed pixels and the
patch grid, so a different resize or processor setting is a different key), the call's simple
keyword arguments and the cache's scope (the encoder's ``triptych.identity.model_identity``).
Calls with other arguments (tensors in kwargs, hooks asking for attentions) bypass the cache.
Entries are evicted least-recently-used past ``max_bytes`` of stored tensors; a hit returns clones,
so nothing downstream can alter a stored entry.

Installed with diffusers' hook registry (``install``), like the other accelerations, on the module
whose forward is the vision encoder (``text_encoder.model.visual`` for Qwen2.5-VL).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
from diffusers.hooks import HookRegistry, ModelHook

from triptych.cache.mm_stats import MMCacheStats

HOOK_NAME = "triptych_mm_cache"
#: The tenant whose request the current encode serves (set by the caller around an encode or a chat,
#: ``tenant_scope``); part of every key, so one tenant's entries never serve another's requests.
TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("triptych_mm_tenant", default="")
SIMPLE = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class MMCacheConfig:
    """The encoder's mm-hash cache, one per loaded encoder (a family builds it from this)."""

    max_mb: float = 256.0
    """Budget in MiB (2**20 bytes) of stored encoder outputs; past it the least recently used entries
    are evicted. 0 turns the cache off."""

    def __post_init__(self) -> None:
        if isinstance(self.max_mb, bool) or not isinstance(self.max_mb, (int, float)):
            raise ValueError(f"MMCacheConfig.max_mb={self.max_mb!r}: must be a number of MiB (0 turns the cache off)")
        if not (math.isfinite(self.max_mb) and self.max_mb >= 0):
            raise ValueError(
                f"MMCacheConfig.max_mb={self.max_mb}: must be a finite number >= 0 (0 turns the cache off)"
            )

    @property
    def max_bytes(self) -> int:
        return int(self.max_mb * (1 << 20))


def content_hash(*tensors: torch.Tensor, extra: str = "") -> str:
    """SHA-256 of each tensor's dtype, shape and bytes (in order), then ``extra``."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    h.update(extra.encode())
    return h.hexdigest()


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    return [t for v in values for t in _tensors(v)]


def _clone(out: Any) -> Any:
    """A copy whose tensors are fresh clones (ModelOutput, dict, tuple, list or tensor)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, dict):  # transformers' ModelOutput is an OrderedDict dataclass
        return type(out)(**{k: _clone(v) for k, v in out.items()})
    if isinstance(out, (tuple, list)):
        return type(out)(_clone(v) for v in out)
    return out


class MMEmbeddingCache:
    """LRU of encoder outputs by content hash, bounded by the bytes of the stored tensors."""

    def __init__(self, max_bytes: int = 256 << 20, scope: str = ""):
        """``scope`` goes into every key: the encoder's identity (model revision); the tenant of the
        request (``tenant_scope``) joins it per lookup."""
        if max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes}: must be >= 0 (0 disables the cache)")
        self.max_bytes = max_bytes
        self.scope = scope
        self.stats = MMCacheStats()
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def snapshot(self) -> MMCacheStats:
        """The counters so far and the size now (a copy: lookups keep counting into ``stats``)."""
        with self._lock:
            return msgspec.structs.replace(self.stats, entries=len(self._entries), nbytes=self._bytes)

    def get(self, key: str) -> Any | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                return None
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return _clone(found[0])

    def put(self, key: str, value: Any) -> None:
        size = sum(t.numel() * t.element_size() for t in _tensors(value))
        if size > self.max_bytes:
            return
        stored = _clone(value)
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = (stored, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, freed) = self._entries.popitem(last=False)
                self._bytes -= freed
                self.stats.evictions += 1


class _EncoderCacheHook(ModelHook):
    def __init__(self, cache: MMEmbeddingCache):
        super().__init__()
        self.cache = cache

    def new_forward(self, module: torch.nn.Module, *args, **kwargs):
        run = self.fn_ref.original_forward
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        tensors += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
        simple = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor) and k not in UNKEYED}
        if any(not isinstance(a, (torch.Tensor, *SIMPLE)) for a in args) or any(
            not isinstance(v, SIMPLE) for v in simple.values()
        ):
            self.cache.stats.bypassed += 1
            return run(*args, **kwargs)
        shape = (len(args), tuple(k for k, v in kwargs.items() if isinstance(v, torch.Tensor)))
        extra = repr((shape, sorted(simple.items()), [a for a in args if not isinstance(a, torch.Tensor)]))
        key = content_hash(*tensors, extra=f"{self.cache.scope}|tenant={TENANT.get()}|{extra}")
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        self.cache.stats.misses += 1
        out = _without_per_layer(run(*args, **kwargs))
        self.cache.put(key, out)
        return out


#: Keyword arguments left out of the key. ``output_hidden_states`` reaches Qwen2.5-VL's vision tower
#: only because the caller asked the *language model* for its hidden states (QwenImage's prompt
#: encoding does; ``generate`` for chat does not); it adds the tower's per-block states to the output
#: and changes nothing else. Left out, an edit encode and a chat about the same image share one entry.
UNKEYED = ("output_hidden_states",)


def _without_per_layer(out: Any) -> Any:
    """The output with the tower's per-block ``hidden_states`` / ``attentions`` dropped (set to None):
    every cached entry has the same fields however it was first computed. No consumer of the tower
    reads them (Qwen2.5-VL's ``get_image_features`` keeps ``pooler_output``)."""
    for name in ("hidden_states", "attentions"):
        if isinstance(out, dict) and out.get(name) is not None:
            out[name] = None
    return out


@contextlib.contextmanager
def tenant_scope(tenant: str):
    """Key the mm-hash cache lookups made inside this block by ``tenant`` ("" = the shared scope)."""
    token = TENANT.set(tenant)
    try:
        yield
    finally:
        TENANT.reset(token)


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
