"""Seeded tiny FLUX checkpoints (dev-style with guidance embedding, or schnell-style)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from triptych.families.tiny.tokenizers import train_clip_tokenizer, train_t5_tokenizer

SIZES = {
    # ~0.2M-parameter transformer: unit tests.
    "tiny": dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2, text_dim=32),
    # ~50M-parameter transformer: benchmarks.
    "small": dict(num_layers=4, num_single_layers=8, attention_head_dim=64, num_attention_heads=6, text_dim=256),
}


def make_tiny_flux(out: str | Path, seed: int = 0, size: str = "tiny", schnell: bool = False) -> Path:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    cfg = SIZES[size]
    out = Path(out)
    torch.manual_seed(seed)
    clip_tok = train_clip_tokenizer()
    t5_tok = train_t5_tokenizer()
    head_dim = cfg["attention_head_dim"]
    rope = [head_dim // 4, head_dim // 4, head_dim // 2]
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=cfg["num_layers"],
        num_single_layers=cfg["num_single_layers"],
        attention_head_dim=head_dim,
        num_attention_heads=cfg["num_attention_heads"],
        joint_attention_dim=cfg["text_dim"],
        pooled_projection_dim=32,
        guidance_embeds=not schnell,
        axes_dims_rope=rope,
    )
    torch.manual_seed(seed + 1)
    clip = CLIPTextModel(
        CLIPTextConfig(
            bos_token_id=clip_tok.bos_token_id,
            eos_token_id=clip_tok.eos_token_id,
            pad_token_id=clip_tok.pad_token_id,
            hidden_size=32,
            intermediate_size=37,
            num_attention_heads=4,
            num_hidden_layers=2,
            vocab_size=len(clip_tok),
            projection_dim=32,
            max_position_embeddings=77,
        )
    )
    torch.manual_seed(seed + 2)
    t5 = T5EncoderModel(
        T5Config(
            d_model=cfg["text_dim"],
            d_kv=8,
            num_heads=4,
            num_layers=2,
            d_ff=37,
            vocab_size=len(t5_tok),
            pad_token_id=t5_tok.pad_token_id,
            eos_token_id=t5_tok.eos_token_id,
            decoder_start_token_id=0,
        )
    )
    torch.manual_seed(seed + 3)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=64,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    if schnell:
        scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False)
    else:
        scheduler = FlowMatchEulerDiscreteScheduler(
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        )
    pipe = FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=clip,
        tokenizer=clip_tok,
        text_encoder_2=t5,
        tokenizer_2=t5_tok,
        transformer=transformer,
    )
    pipe.save_pretrained(out)
    defaults = {"height": 64, "width": 64, "steps": 4, "guidance": 3.5, "seed": seed, "size": size}
    (out / "triptych.json").write_text(json.dumps(defaults, indent=2))
    return out


def make_tiny_flux_schnell(out: str | Path, seed: int = 0, size: str = "tiny") -> Path:
    return make_tiny_flux(out, seed=seed, size=size, schnell=True)
