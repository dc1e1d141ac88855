"""The transformer inputs a family's pipeline builds for one size, as meta-tensor rows, and the family's
own forward to run on them: each family's ``denoise.forward`` over ``Row``s whose states hold meta
tensors shaped as its ``prepare`` and encoder would make them, so a count covers what serving runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from triptych.families.base import COND, UNCOND, Conditioning, DenoiseState, GenerationParams, Row

META = torch.device("meta")


@dataclass(frozen=True)
class Geometry:
    """What the configs say about a model's latent layout (no weights needed)."""

    family: str
    scale: int  # VAE spatial downsampling
    latent_channels: int  # the VAE's z channels
    temporal: int = 1  # VAE temporal downsampling (video)
    text_tokens: int | None = None  # prompt tokens one branch carries when fixed by padding; None: per prompt
    requires_image: bool = False


def _empty(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=META)


def latent_tokens(g: Geometry, height: int, width: int, frames: int = 1) -> int:
    """Image-stream tokens of one row: 2×2 patches of the latent grid, times latent frames."""
    latent_frames = (frames - 1) // g.temporal + 1
    return latent_frames * (height // (g.scale * 2)) * (width // (g.scale * 2))


def _state(params: GenerationParams, latents, branches: dict[str, dict], shared=None, aux=None) -> DenoiseState:
    cond = Conditioning(branches=branches, shared=shared or {})
    timesteps = torch.ones(1, device=META)
    return DenoiseState("plan", params, latents, None, timesteps, cond, aux or {})


def flux_rows(cfg: dict, g: Geometry, p: GenerationParams, text: dict[str, int]) -> list[Row]:
    from diffusers import FluxPipeline

    h, w = p.height // (g.scale * 2), p.width // (g.scale * 2)
    latents = _empty(1, h * w, cfg["in_channels"])
    img_ids = FluxPipeline._prepare_latent_image_ids(1, h, w, META, torch.bfloat16)
    aux = {"img_ids": img_ids}
    if cfg.get("guidance_embeds"):
        aux["guidance"] = _empty(1, dtype=torch.float32)
    branches = {
        b: {
            "prompt_embeds": _empty(1, n, cfg["joint_attention_dim"]),
            "pooled_prompt_embeds": _empty(1, cfg["pooled_projection_dim"]),
            "text_ids": _empty(n, 3),
        }
        for b, n in text.items()
    }
    return [Row(_state(p, latents, branches, aux=aux), b) for b in branches]


def qwen_rows(cfg: dict, g: Geometry, p: GenerationParams, text: dict[str, int]) -> list[Row]:
    h, w = p.height // (g.scale * 2), p.width // (g.scale * 2)
    latents = _empty(1, h * w, cfg["in_channels"])
    shared = {}
    if g.requires_image:  # edit: the condition image's latents, taken here at the output's size
        shared = {"image_latents": _empty(1, h * w, cfg["in_channels"]), "image_shape": torch.tensor([1, h, w])}
    branches = {b: {"prompt_embeds": _empty(1, n, cfg["joint_attention_dim"])} for b, n in text.items()}
    return [Row(_state(p, latents, branches, shared), b) for b in branches]


def wan_rows(cfg: dict, g: Geometry, p: GenerationParams, text: dict[str, int]) -> list[Row]:
    latent_frames = (p.frames - 1) // g.temporal + 1
    grid = (latent_frames, p.height // g.scale, p.width // g.scale)
    latents = _empty(1, g.latent_channels, *grid, dtype=torch.float32)  # WanPipeline's float32 noise
    shared = {}
    if g.requires_image:  # image-to-video: mask ‖ first-frame latents, and the CLIP image embeddings
        shared["condition"] = _empty(1, cfg["in_channels"] - g.latent_channels, *grid, dtype=torch.float32)
        if cfg.get("image_dim"):
            shared["image_embeds"] = _empty(1, 257, cfg["image_dim"])
    branches = {b: {"prompt_embeds": _empty(1, n, cfg["text_dim"])} for b, n in text.items()}
    return [Row(_state(p, latents, branches, shared), b) for b in branches]


def forward_of(family: str, g: Geometry) -> Callable[[Any, Sequence[Row]], torch.Tensor]:
    """The family's own ``denoise.forward(transformer, rows)``."""
    if family == "flux":
        from triptych.families.flux import denoise

        return denoise.forward
    if family.startswith("qwen-image"):
        from triptych.families.qwenimage import denoise

        return lambda transformer, rows: denoise.forward(transformer, rows, g.scale)
    from triptych.families.wan import denoise

    return denoise.forward


ROWS = {
    "flux": flux_rows,
    "qwen-image": qwen_rows,
    "qwen-image-edit": qwen_rows,
    "wan-t2v": wan_rows,
    "wan-i2v": wan_rows,
}


def meta_rows(family: str, cfg: dict, g: Geometry, p: GenerationParams, text: dict[str, int]) -> list[Row]:
    """One row per branch in ``text`` (branch → its prompt tokens) for resolved ``params``."""
    return ROWS[family](cfg, g, p, text)


def geometry(family: str, model_dir: Path, vae: dict | None, defaults: dict, requires_image: bool) -> Geometry:
    """The latent layout from the VAE config (the families' own fallbacks where it is missing)."""
    vae = vae or {}
    if family == "flux":
        scale = 2 ** (len(vae.get("block_out_channels", (0,) * 4)) - 1)
        return Geometry(family, scale, vae.get("latent_channels", 16), text_tokens=512)
    if family.startswith("qwen-image"):
        scale = 2 ** len(vae.get("temperal_downsample", (0,) * 3))
        return Geometry(family, scale, vae.get("z_dim", 16), requires_image=requires_image)
    scale = vae.get("scale_factor_spatial") or 8
    temporal = vae.get("scale_factor_temporal") or 4
    text = defaults.get("max_sequence_length", 512)
    return Geometry(family, scale, vae.get("z_dim", 16), temporal, text, requires_image)


BRANCHES = (COND, UNCOND)
