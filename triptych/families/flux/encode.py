"""FLUX encode stage: CLIP pooled + T5 sequence embeddings, via the pipeline's own encode_prompt."""

from __future__ import annotations

from collections.abc import Sequence

from triptych.families.base import COND, UNCOND, Conditioning, GenerationParams


def encode(pipe, params: GenerationParams, max_sequence_length: int, true_cfg: bool, device) -> Conditioning:
    branches = {COND: _encode_one(pipe, params.prompt, max_sequence_length, device)}
    if true_cfg:
        branches[UNCOND] = _encode_one(pipe, params.negative_prompt, max_sequence_length, device)
    return Conditioning(branches=branches)


def _encode_one(pipe, prompt: str, max_sequence_length: int, device) -> dict:
    return encode_rows(pipe, [prompt], max_sequence_length, device)[0]


def encode_rows(pipe, prompts: Sequence[str], max_sequence_length: int, device) -> list[dict]:
    """Every prompt in one ``encode_prompt`` call (one forward per text encoder), one dict per prompt.
    Each encoder pads every prompt to its fixed length, so a row does not depend on the others."""
    embeds, pooled, text_ids = pipe.encode_prompt(
        prompt=list(prompts), prompt_2=None, device=device, max_sequence_length=max_sequence_length
    )
    return [
        {"prompt_embeds": embeds[i : i + 1], "pooled_prompt_embeds": pooled[i : i + 1], "text_ids": text_ids}
        for i in range(len(prompts))
    ]
