"""Seeded tiny Qwen-Image / Qwen-Image-Edit checkpoints, built from configs (no hub files).

``build_components(dims, seed, edit)`` returns the pipeline's constructor arguments for any
``QwenImageDims``, so training code can build an untrained model of its own size;
``make_tiny_qwen_image[_edit]`` save them as diffusers directories that load with
``QwenImagePipeline/QwenImageEditPipeline.from_pretrained(dir)`` offline (for edit, import
``triptych.families.qwenimage.processor`` first: the saved processor class lives there).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from triptych.families.qwenimage.tokenizer import train_qwen_tokenizer


@dataclass(frozen=True)
class QwenImageDims:
    """Sizes of a Qwen-Image model; the defaults are the unit-test model."""

    layers: int = 2
    """Transformer (MMDiT) blocks."""
    heads: int = 2
    head_dim: int = 16
    """Attention head width; the 3-axis RoPE splits it as ``rope_axes``."""
    rope_axes: tuple[int, int, int] = (8, 4, 4)
    """(frame, height, width) RoPE dims; must sum to ``head_dim``."""
    z_dim: int = 4
    """VAE latent channels; the transformer sees 2×2 patches, so ``in_channels = 4 * z_dim``."""
    vae_base_dim: int = 8
    vae_dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    """One entry per VAE level; spatial scale factor is ``2 ** (len - 1)`` (8 here, as the real VAE)."""
    text_dim: int = 32
    """Qwen2.5-VL hidden size = the transformer's ``joint_attention_dim``."""
    text_layers: int = 2
    text_heads: int = 2
    """Text head width ``text_dim / text_heads`` must be a multiple of 8 (M-RoPE sections)."""
    text_mlp: int = 64
    vision_dim: int = 16
    vision_layers: int = 2
    vision_heads: int = 2
    image_max_pixels: int = 112 * 112
    """Processor resize bound: the condition image becomes at most (112/28)² = 16 vision tokens."""
    vocab_size: int = 2000
    """Upper bound for BPE training; the corpus decides the real size."""

    def __post_init__(self):
        if sum(self.rope_axes) != self.head_dim:
            raise ValueError(f"rope_axes {self.rope_axes} must sum to head_dim={self.head_dim}")
        if (self.text_dim // self.text_heads) % 8:
            raise ValueError(f"text head width {self.text_dim // self.text_heads} must be a multiple of 8")


SIZES = {
    # ~0.1M-parameter transformer: unit tests.
    "tiny": QwenImageDims(),
    # ~50M-parameter transformer: benchmarks.
    "small": QwenImageDims(
        layers=9,
        heads=6,
        head_dim=64,
        rope_axes=(16, 24, 24),
        text_dim=256,
        text_heads=4,
        text_mlp=512,
        vision_dim=64,
        vision_heads=4,
    ),
}


def _text_encoder(dims: QwenImageDims, tokenizer):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    quarter = dims.text_dim // dims.text_heads // 8  # M-RoPE sections (t, h, w) sum to half the head width
    mrope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [quarter, quarter, 2 * quarter]}
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=dims.text_dim,
            intermediate_size=dims.text_mlp,
            num_hidden_layers=dims.text_layers,
            num_attention_heads=dims.text_heads,
            num_key_value_heads=dims.text_heads,
            max_position_embeddings=4096,
            rope_parameters=mrope,
            bos_token_id=tokenizer.pad_token_id,
            eos_token_id=ids("<|im_end|>"),
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            depth=dims.vision_layers,
            hidden_size=dims.vision_dim,
            intermediate_size=dims.vision_dim * 2,
            num_heads=dims.vision_heads,
            out_hidden_size=dims.text_dim,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[dims.vision_layers - 1],
        ),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def build_components(
    dims: QwenImageDims = QwenImageDims(), seed: int = 0, edit: bool = False, extra_corpus: Iterable[str] = ()
) -> dict[str, Any]:
    """Untrained, seeded constructor arguments of ``QwenImagePipeline`` (``edit``: ``QwenImageEditPipeline``).

    ``extra_corpus`` adds prompts to the tokenizer's training text (whole-word tokens for them).
    """
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    tokenizer = train_qwen_tokenizer(vocab_size=dims.vocab_size, extra_corpus=extra_corpus)
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * dims.z_dim,
        out_channels=dims.z_dim,
        num_layers=dims.layers,
        attention_head_dim=dims.head_dim,
        num_attention_heads=dims.heads,
        joint_attention_dim=dims.text_dim,
        guidance_embeds=False,
        axes_dims_rope=dims.rope_axes,
    )
    torch.manual_seed(seed + 1)
    text_encoder = _text_encoder(dims, tokenizer)
    torch.manual_seed(seed + 2)
    levels = len(dims.vae_dim_mult)
    vae = AutoencoderKLQwenImage(
        base_dim=dims.vae_base_dim,
        z_dim=dims.z_dim,
        dim_mult=list(dims.vae_dim_mult),
        num_res_blocks=1,
        temperal_downsample=[False] + [True] * (levels - 2),
        latents_mean=[0.0] * dims.z_dim,
        latents_std=[1.0] * dims.z_dim,
    )
    # Qwen-Image's scheduler settings (dynamic exponential shift, terminal 0.02).
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )
    components = dict(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
    if edit:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        from triptych.families.qwenimage.processor import CHAT_TEMPLATE, QwenImageEditProcessor

        image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=dims.image_max_pixels)
        components["processor"] = QwenImageEditProcessor(
            image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE
        )
    return components


def save_model(components: dict[str, Any], out: str | Path, defaults: dict[str, Any]) -> Path:
    """Write a diffusers directory plus the ``triptych.json`` defaults beside ``model_index.json``."""
    from diffusers import QwenImageEditPipeline, QwenImagePipeline

    out = Path(out)
    cls = QwenImageEditPipeline if "processor" in components else QwenImagePipeline
    cls(**components).save_pretrained(out)
    (out / "triptych.json").write_text(json.dumps(defaults, indent=2))
    return out


def _defaults(seed: int, size: str, dims: QwenImageDims) -> dict[str, Any]:
    return {
        "height": 64,
        "width": 64,
        "steps": 4,
        "guidance": 4.0,
        "seed": seed,
        "size": size,
        "dims": dataclasses.asdict(dims),
    }


def make_tiny_qwen_image(out: str | Path, seed: int = 0, size: str = "tiny") -> Path:
    dims = SIZES[size]
    return save_model(build_components(dims, seed), out, _defaults(seed, size, dims))


def make_tiny_qwen_image_edit(out: str | Path, seed: int = 0, size: str = "tiny") -> Path:
    dims = SIZES[size]
    return save_model(build_components(dims, seed, edit=True), out, _defaults(seed, size, dims))
