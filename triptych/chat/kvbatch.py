"""The running chats' KV caches gathered into one left-padded batch.

Row ``i`` of every layer's keys and values is chat ``i``'s cache, right-aligned: the columns before
its own tokens are padding, masked out by ``mask`` (B, T) (1 = a real token). A decode step appends
one column for every row (``step_mask`` / ``appended``, or ``stepped`` after a forward shared with
prefill rows); a chat joins with its prefilled cache
(the shorter side is padded on the left) and leaves by row selection, after which columns that are
padding in every remaining row are dropped. Positions are per row and explicit (``Prompt``), so the
padding never shifts a chat's rope positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values (B, heads, T, head_dim)


def layers_of(cache: DynamicCache) -> KV:
    return [(layer.keys, layer.values) for layer in cache.layers]


def cache_of(kv: KV, config) -> DynamicCache:
    """A ``DynamicCache`` holding ``kv`` (the model's own cache class, so its mask code applies)."""
    return DynamicCache(ddp_cache_data=kv, config=config)


def nbytes(kv: KV) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


def _pad_left(kv: KV, n: int) -> KV:
    return kv if n == 0 else [(F.pad(k, (0, 0, n, 0)), F.pad(v, (0, 0, n, 0))) for k, v in kv]


class KVBatch:
    def __init__(self, config):
        self.config = config
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.long)

    def __len__(self) -> int:
        return int(self.mask.shape[0])

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    def join(self, kv: KV) -> None:
        """Append one chat (its cache: batch 1, length L) as the last row."""
        length = int(kv[0][0].shape[-2])
        own = torch.ones(1, length, dtype=torch.long, device=kv[0][0].device)
        if self.cache is None:
            self.cache, self.mask = cache_of(kv, self.config), own
            return
        width = max(self.width, length)
        old = _pad_left(layers_of(self.cache), width - self.width)
        new = _pad_left(kv, width - length)
        merged = [(torch.cat([k0, k1]), torch.cat([v0, v1])) for (k0, v0), (k1, v1) in zip(old, new)]
        self.mask = torch.cat([F.pad(self.mask, (width - self.width, 0)), F.pad(own, (width - length, 0))])
        self.cache = cache_of(merged, self.config)

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order); the others' KV is freed."""
        if len(rows) == len(self):
            return
        if not rows:
            self.cache, self.mask = None, torch.zeros(0, 0, dtype=torch.long)
            return
        index = torch.tensor(rows, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        first = int(mask.any(0).long().argmax())  # columns before it are padding in every kept row
        kv = [
            (k.index_select(0, index)[:, :, first:], v.index_select(0, index)[:, :, first:])
            for k, v in layers_of(self.cache)
        ]
        self.mask = mask[:, first:].contiguous()
        self.cache = cache_of(kv, self.config)

    def step_mask(self) -> torch.Tensor:
        """The attention mask of a decode step: every row's tokens so far plus the new one."""
        return F.pad(self.mask, (0, 1), value=1)

    def appended(self) -> None:
        """The step's forward appended one column to the cache."""
        self.mask = F.pad(self.mask, (0, 1), value=1)

    def stepped(self, kv: KV) -> None:
        """A mixed forward (``prefill.prefill`` with ``Decode`` rows) gave every row's KV one column
        longer, as a decode step does: it becomes the batch's cache."""
        self.cache = cache_of(kv, self.config)
        self.appended()
