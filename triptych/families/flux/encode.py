"""FLUX encode stage: CLIP pooled + T5 sequence embeddings, via the pipeline's own encode_prompt."""

from __future__ import annotations

from triptych.families.base import COND, UNCOND, Conditioning, GenerationParams


def encode(pipe, params: GenerationParams, max_sequence_length: int, true_cfg: bool) -> Conditioning:
    branches = {COND: _encode_one(pipe, params.prompt, max_sequence_length)}
    if true_cfg:
        branches[UNCOND] = _encode_one(pipe, params.negative_prompt, max_sequence_length)
    return Conditioning(branches=branches)


def _encode_one(pipe, prompt: str, max_sequence_length: int) -> dict:
    embeds, pooled, text_ids = pipe.encode_prompt(
        prompt=prompt, prompt_2=None, device=pipe._execution_device, max_sequence_length=max_sequence_length
    )
    return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled, "text_ids": text_ids}
