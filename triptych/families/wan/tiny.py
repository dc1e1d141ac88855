"""Seeded tiny Wan 2.1 checkpoints (text-to-video and image-to-video), built from configs offline.

Components follow diffusers' ``get_dummy_components()`` for Wan (2 layers, 2 heads of 12, tiny
``AutoencoderKLWan`` with ``dim_mult=[1, 1, 1, 1]``: spatial scale 8, temporal scale 4). The
scheduler is the one real Wan 2.1 checkpoints ship (``UniPCMultistepScheduler`` with flow sigmas),
not the test suite's FlowMatchEuler: it is a multistep solver, so it exercises per-request history.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from triptych.families.tiny.tokenizers import train_t5_tokenizer

SIZES = {
    # ~50K-parameter transformer: unit tests.
    "tiny": dict(
        num_layers=2,
        num_attention_heads=2,
        attention_head_dim=12,
        ffn_dim=32,
        text_dim=32,
        image_dim=16,
        height=32,
        width=32,
        frames=5,
        max_sequence_length=64,
    ),
    # ~50M-parameter transformer: benchmarks.
    "small": dict(
        num_layers=11,
        num_attention_heads=8,
        attention_head_dim=64,
        ffn_dim=2048,
        text_dim=256,
        image_dim=64,
        height=64,
        width=64,
        frames=9,
        max_sequence_length=512,
    ),
}


def make_tiny_wan_t2v(out: str | Path, seed: int = 0, size: str = "tiny") -> Path:
    from diffusers import WanPipeline

    cfg = SIZES[size]
    parts = _shared_components(cfg, seed, in_channels=16, image_dim=None)
    pipe = WanPipeline(**parts)
    return _save(pipe, out, cfg, seed, size)


def make_tiny_wan_i2v(out: str | Path, seed: int = 0, size: str = "tiny") -> Path:
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPVisionConfig, CLIPVisionModel

    cfg = SIZES[size]
    # in_channels = 16 noise + 4 first-frame mask + 16 condition latents.
    parts = _shared_components(cfg, seed, in_channels=36, image_dim=cfg["image_dim"])
    torch.manual_seed(seed + 4)
    image_encoder = CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=cfg["image_dim"],
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=4,
            projection_dim=cfg["image_dim"],
        )
    )
    pipe = WanImageToVideoPipeline(**parts, image_encoder=image_encoder, image_processor=_clip_image_processor())
    return _save(pipe, out, cfg, seed, size)


def _shared_components(cfg: dict, seed: int, in_channels: int, image_dim: int | None) -> dict:
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=cfg["num_attention_heads"],
        attention_head_dim=cfg["attention_head_dim"],
        in_channels=in_channels,
        out_channels=16,
        text_dim=cfg["text_dim"],
        freq_dim=256,
        ffn_dim=cfg["ffn_dim"],
        num_layers=cfg["num_layers"],
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
        image_dim=image_dim,
    )
    tokenizer = train_t5_tokenizer()
    torch.manual_seed(seed + 1)
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            d_model=cfg["text_dim"],
            d_kv=8,
            num_heads=4,
            num_layers=2,
            d_ff=37,
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=0,
        )
    )
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    # Wan 2.1's shipped scheduler config (480p flow shift).
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, num_train_timesteps=1000
    )
    return dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer)


def _clip_image_processor():
    # Without torchvision ``CLIPImageProcessor`` falls back to the PIL backend with a warning: ask for it.
    try:
        from transformers import CLIPImageProcessorPil as Processor
    except ImportError:
        from transformers import CLIPImageProcessor as Processor
    return Processor(crop_size=32, size=32)


def _save(pipe, out: str | Path, cfg: dict, seed: int, size: str) -> Path:
    out = Path(out)
    pipe.save_pretrained(out)
    defaults = {
        "height": cfg["height"],
        "width": cfg["width"],
        "frames": cfg["frames"],
        "steps": 4,
        "guidance": 5.0,
        "max_sequence_length": cfg["max_sequence_length"],
        "seed": seed,
        "size": size,
    }
    (out / "triptych.json").write_text(json.dumps(defaults, indent=2))
    return out
