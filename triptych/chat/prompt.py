"""A chat's prompt as the engine feeds it: token ids, explicit 3-D rope positions, the prefix key and
the input embeddings of any slice (images scattered in from the vision tower).

Positions are computed once per prompt with the model's own ``get_rope_index`` and always passed
explicitly: the model's ``rope_deltas`` attribute is state that ``generate`` and edit encodes also
set, so the engine never reads or writes it. After the prompt, every decode position is one more
than the last (``next_position``), the same in all three rope dimensions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from triptych.mmcache.cache import content_hash


@dataclass
class Prompt:
    input_ids: torch.Tensor  # (L,) int64
    positions: torch.Tensor  # (3, L) rope positions (temporal, height, width)
    next_position: int  # the first decode position
    #: the prefix-cache key: the tenant, then one item per token: its id, or for an image token
    #: the content hash of its image (the same text with another image never matches)
    key: tuple
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    #: per image, in prompt order: (first token, end token, first patch, end patch); an image's
    #: tokens are contiguous in the prompt and its patches in ``pixel_values``
    images: tuple[tuple[int, int, int, int], ...] = ()

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def image_token_id(model) -> int:
    return int(model.config.image_token_id)


def build_prompt(model, inputs: dict[str, torch.Tensor], tenant: str) -> Prompt:
    """``inputs``: the processor's output for one prompt (``ChatModel.inputs``)."""
    ids = inputs["input_ids"]
    types = inputs.get("mm_token_type_ids")
    types = torch.zeros_like(ids) if types is None else types
    grid = inputs.get("image_grid_thw")
    positions, _ = model.model.get_rope_index(ids, types, grid, None, attention_mask=inputs.get("attention_mask"))
    ids, positions = ids[0], positions[:, 0]
    pixels = inputs.get("pixel_values")
    return Prompt(
        ids,
        positions,
        int(positions.max()) + 1,
        (tenant, *_key_items(model, ids, pixels, grid)),
        pixels,
        grid,
        _spans(model, ids, grid),
    )


def _spans(model, ids: torch.Tensor, grid) -> tuple[tuple[int, int, int, int], ...]:
    if grid is None:
        return ()
    merge = int(model.config.vision_config.spatial_merge_size) ** 2
    where = (ids == image_token_id(model)).nonzero().flatten().tolist()
    spans, patch, token = [], 0, 0
    for thw in grid:
        patches = int(thw.prod())
        count = patches // merge
        if token + count > len(where):
            raise ValueError(f"the prompt holds {len(where)} image tokens but its images need {token + count}")
        spans.append((where[token], where[token] + count, patch, patch + patches))
        patch, token = patch + patches, token + count
    return tuple(spans)


def _key_items(model, ids: torch.Tensor, pixels, grid) -> list:
    items: list = ids.tolist()
    if grid is None:
        return items
    merge = int(model.config.vision_config.spatial_merge_size) ** 2
    where = (ids == image_token_id(model)).nonzero().flatten().tolist()
    patch, token = 0, 0
    for thw in grid:
        patches = int(thw.prod())
        digest = content_hash(pixels[patch : patch + patches], thw)
        for i in where[token : token + patches // merge]:
            items[i] = digest
        patch, token = patch + patches, token + patches // merge
    return items


def chunk_embeddings(model, prompt: Prompt, start: int, end: int, features: dict[int, torch.Tensor]) -> torch.Tensor:
    """The input embeddings of ``prompt[start:end]``, shape (end - start, hidden), each image's
    vision-tower output scattered over its tokens. The tower runs once per image (one call per
    image, so its mm-hash cache keys each image on its own), only for the images this chunk
    touches; ``features`` holds (image index -> embeddings) across the chunks of one prompt and
    drops an image once the chunk passes its end."""
    embeds = model.get_input_embeddings()(prompt.input_ids[start:end])
    for j, (t0, t1, p0, p1) in enumerate(prompt.images):
        if t1 <= start or t0 >= end:
            continue
        got = features.get(j)
        if got is None:
            out = model.model.get_image_features(
                prompt.pixel_values[p0:p1], prompt.image_grid_thw[j : j + 1], return_dict=True
            )
            got = torch.cat(list(out.pooler_output)).to(embeds.device, embeds.dtype)
            if got.shape[0] != t1 - t0:
                raise ValueError(
                    f"image {j} of the prompt has {t1 - t0} placeholder tokens "
                    f"but the vision tower gave {got.shape[0]} embeddings for it"
                )
            features[j] = got
        lo, hi = max(start, t0), min(end, t1)
        embeds[lo - start : hi - start] = got[lo - t0 : hi - t0]
        if t1 <= end:
            del features[j]
    return embeds
