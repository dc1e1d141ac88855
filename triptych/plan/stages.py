"""One count per stage on meta modules: a transformer forward over a family's rows, a text (or image)
encoder forward at the token count the pipeline feeds it, a VAE decode of one output."""

from __future__ import annotations

import torch

from triptych.families.base import GenerationParams
from triptych.plan.inputs import META, Geometry, forward_of, meta_rows
from triptych.plan.trace import Count, count

#: tokens the Qwen-Image pipelines' chat template puts before the prompt (their ``prompt_template_encode_start_idx``
#: for text-to-image); the encoder runs them, the transformer never sees them
QWEN_TEMPLATE_TOKENS = 34


def transformer_forward(transformer, g: Geometry, p: GenerationParams, text: dict[str, int], batch: int = 1) -> Count:
    """One forward over ``batch`` requests' rows of every branch in ``text`` (branch → prompt tokens),
    stacked as the engine fuses them (the family pads unequal prompts itself)."""
    rows = meta_rows(g.family, dict(transformer.config), g, p, text)
    stacked = [r for r in rows for _ in range(batch)]
    run = forward_of(g.family, g)
    return count(lambda: run(transformer, stacked))


def encoder_tokens(config: dict, g: Geometry, prompt_tokens: int) -> int:
    """Tokens one prompt is run through a text encoder with."""
    kind = config.get("model_type", "")
    if kind.startswith("clip"):
        return int(config.get("max_position_embeddings", 77))
    if kind.startswith("qwen"):
        return prompt_tokens + QWEN_TEMPLATE_TOKENS
    return g.text_tokens or prompt_tokens


def encoder_forward(encoder, g: Geometry, prompt_tokens: int, prompts: int = 1) -> Count:
    """One forward of a text encoder (or CLIP vision tower) over ``prompts`` prompts."""
    config = encoder.config.to_dict()
    if config.get("model_type") == "clip_vision_model":
        size = int(config.get("image_size", 224))
        pixels = torch.empty(prompts, 3, size, size, device=META, dtype=encoder.dtype)
        return count(lambda: encoder(pixel_values=pixels, output_hidden_states=True))
    tokens = encoder_tokens(config, g, prompt_tokens)
    ids = torch.zeros(prompts, tokens, dtype=torch.long, device=META)
    if config.get("model_type", "").startswith("qwen"):  # text only: its language model, as a prompt encode runs
        embeds = encoder.get_input_embeddings()(ids)
        positions = torch.zeros(3, prompts, tokens, dtype=torch.long, device=META)
        lm = encoder.model.language_model  # Qwen2.5-VL's rope index reads token values: positions given here

        def run():
            hidden = lm(inputs_embeds=embeds, attention_mask=None, position_ids=positions).last_hidden_state
            return encoder.lm_head(hidden)  # the pipeline's call computes every token's logits too

        return count(run)
    # no attention mask: the FLOPs are the same, and a mask makes some encoders read values (not on meta)
    return count(lambda: encoder(input_ids=ids, output_hidden_states=True))


def vae_decode(vae, g: Geometry, p: GenerationParams, images: int = 1) -> Count:
    """One ``vae.decode`` of ``images`` outputs' latents."""
    h, w = p.height // g.scale, p.width // g.scale
    z = g.latent_channels
    if g.family == "flux":
        latents = torch.empty(images, z, h, w, device=META, dtype=vae.dtype)
    else:
        latent_frames = ((p.frames or 1) - 1) // g.temporal + 1
        latents = torch.empty(images, z, latent_frames, h, w, device=META, dtype=vae.dtype)
    return count(lambda: vae.decode(latents, return_dict=False))
