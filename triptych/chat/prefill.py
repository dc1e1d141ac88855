"""Batched prefill: the prompt chunks of several chats in one model forward, optionally with the
running chats' decode tokens in the same forward (mixed prefill and decode, as in chunked prefill).

Each row is one chat's chunk: its new tokens' input embeddings (images already scattered in) and
rope positions, and the KV of the chat's tokens before the chunk (``past``: a prefix-cache hit, the
chunks of earlier steps, or nothing). Rows differ in both lengths, so the forward's keys are laid
out as ``[padding, past | new, padding]``: every row's past right-aligned at column ``P`` (the
longest past), its new tokens left-aligned after it, and the 2-D attention mask marks the padding.
The padding of the new part comes after a row's real tokens, so a padded query always sees real
keys (no fully masked softmax row, no NaN), and the real tokens never see the padding.

``Decode`` rows (the running chats' ``KVBatch``: left-padded, so each row's past already ends at
its last column) come first in the same layout, each with one new token: their query padding is
the longest chunk's length minus one, masked as keys and never read. After the forward their KV is
the batch's columns plus the one new column (``[P - width, P + 1)``), the batch one token longer.

After the forward, row ``i``'s KV (its past and its new tokens) is the contiguous column range
``[P - past_i, P + new_i)`` of the batch cache; ``split`` copies it out so that each chat owns its
storage (no view pins the batch's tensors). The logits are those of each row's last real token,
taken through the model's ``lm_head`` on that one hidden state. Positions are explicit, so neither
the padding nor the batch mates change a row's result beyond float rounding of batched matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from triptych.chat.kvbatch import KV, cache_of, layers_of


@dataclass
class Row:
    embeds: torch.Tensor  # (n, hidden) the chunk's input embeddings
    positions: torch.Tensor  # (3, n) rope positions
    past: KV | None  # batch-1 KV of the chat's tokens before the chunk

    def __len__(self) -> int:
        return int(self.embeds.shape[0])

    @property
    def past_length(self) -> int:
        return 0 if self.past is None else int(self.past[0][0].shape[-2])


@dataclass
class Decode:
    """The running chats' next tokens, decoded in the same forward as the prefill rows."""

    kv: KV  # the batch's KV (B, heads, width, head_dim), left-padded
    mask: torch.Tensor  # (B, width) 1 = a real token
    embeds: torch.Tensor  # (B, hidden) the input embeddings of each row's last token
    positions: torch.Tensor  # (3, B) each row's next rope position

    def __len__(self) -> int:
        return int(self.mask.shape[0])

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])


def _batched_past(rows: list[Row], width: int, decode: Decode | None) -> KV:
    template = decode.kv if decode is not None else next(r.past for r in rows if r.past is not None)
    layers = []
    for layer, (k0, v0) in enumerate(template):
        keys, values = [], []
        if decode is not None:
            keys.append(F.pad(k0, (0, 0, width - decode.width, 0)))
            values.append(F.pad(v0, (0, 0, width - decode.width, 0)))
        for row in rows:
            if row.past is None:
                keys.append(k0.new_zeros(1, k0.shape[1], width, k0.shape[3]))
                values.append(v0.new_zeros(1, v0.shape[1], width, v0.shape[3]))
            else:
                k, v = row.past[layer]
                pad = width - int(k.shape[-2])
                keys.append(F.pad(k, (0, 0, pad, 0)))
                values.append(F.pad(v, (0, 0, pad, 0)))
        layers.append((torch.cat(keys), torch.cat(values)))
    return layers


@torch.no_grad()
def prefill(model, rows: list[Row], decode: Decode | None = None) -> tuple[list[KV], torch.Tensor, KV | None]:
    """One forward over ``decode``'s rows (if any) and ``rows``; returns each of ``rows``' KV (past +
    chunk, its own storage), the logits of each row's last token, shape (decode rows + rows,
    vocab), decode rows first, and the decode batch's KV one column longer (None without one)."""
    device = model.device
    d = 0 if decode is None else len(decode)
    pasts = [r.past_length for r in rows]
    width = max([*pasts, 0 if decode is None else decode.width])
    longest = max([len(r) for r in rows] + [1])
    first = rows[0].embeds
    embeds = first.new_zeros(d + len(rows), longest, first.shape[-1])
    positions = torch.zeros(3, d + len(rows), longest, dtype=torch.long)
    mask = torch.zeros(d + len(rows), width + longest, dtype=torch.long)
    if decode is not None:
        embeds[:d, 0] = decode.embeds.to(embeds.device, embeds.dtype)
        positions[:, :d] = decode.positions.cpu()[:, :, None]  # the padding: any position (masked as a key)
        mask[:d, width - decode.width : width] = decode.mask.cpu()
        mask[:d, width] = 1
    for i, (row, past) in enumerate(zip(rows, pasts), start=d):
        n = len(row)
        embeds[i, :n] = row.embeds
        positions[:, i, :n] = row.positions
        positions[:, i, n:] = row.positions[:, -1:]  # padding: any position (masked as a key)
        mask[i, width - past : width + n] = 1
    cache = (
        DynamicCache(config=model.config) if width == 0 else cache_of(_batched_past(rows, width, decode), model.config)
    )
    out = model.model(
        inputs_embeds=embeds.to(device),
        attention_mask=mask.to(device),
        position_ids=positions.to(device),
        cache=cache,
        use_cache=True,
    )
    last = torch.tensor([0] * d + [len(r) - 1 for r in rows], device=device)
    hidden = out.last_hidden_state[torch.arange(d + len(rows), device=device), last]
    logits = model.lm_head(hidden[:, None])[:, -1]
    kv = layers_of(cache)
    split = [
        [
            (
                k[i : i + 1, :, width - past : width + len(row)].clone(),
                v[i : i + 1, :, width - past : width + len(row)].clone(),
            )
            for k, v in kv
        ]
        for i, (row, past) in enumerate(zip(rows, pasts), start=d)
    ]
    stepped = None
    if decode is not None:
        lo = width - decode.width
        stepped = [(k[:d, :, lo : width + 1].contiguous(), v[:d, :, lo : width + 1].contiguous()) for k, v in kv]
    return split, logits, stepped
