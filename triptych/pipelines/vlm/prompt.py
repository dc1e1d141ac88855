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

from triptych.cache.mm import content_hash


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
    )


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


def embeddings(model, prompt: Prompt, start: int) -> torch.Tensor:
    """The input embeddings of ``prompt[start:]``, shape (1, L - start, hidden): the vision tower
    (and its mm-hash cache) runs only when an image token lies in that slice."""
    ids = prompt.input_ids[start:]
    embeds = model.get_input_embeddings()(ids[None])
    mask = ids == image_token_id(model)
    if not bool(mask.any()):
        return embeds
    out = model.model.get_image_features(prompt.pixel_values, prompt.image_grid_thw, return_dict=True)
    features = torch.cat(list(out.pooler_output))
    before = int((prompt.input_ids[:start] == image_token_id(model)).sum())
    features = features[before:].to(embeds.device, embeds.dtype)
    if features.shape[0] != int(mask.sum()):
        raise ValueError(
            f"the prompt holds {int(mask.sum())} image tokens after position {start} "
            f"but the vision tower gave {features.shape[0]} embeddings for them"
        )
    return embeds.masked_scatter(mask[None, :, None].expand_as(embeds), features)
