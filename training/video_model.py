"""The tiny Wan 2.1 text-to-video model of the shape world: its components and its directory.

- VAE: the trained default image VAE (``assets/default/vae``, ``AutoencoderKLQwenImage``) loaded
  into ``AutoencoderKLWan`` with the same config, no temporal compression
  (``temperal_downsample=[False, False, False]``, ``scale_factor_temporal=1``). The state dicts
  match key for key. Its causal 3-D convolutions were only ever trained on single frames, so the
  taps on past frames never saw input: they are zeroed (:func:`frame_independent`), and every frame
  is coded independently (``tests/e2e/test_video_model.py``). ``latents_mean/std`` are the image
  VAE's measured ones. :func:`video_vae` takes any VAE with the image VAE's encoder: the shipped
  model's decoder is fine-tuned on clip frames (``train_video_vae``).
- text encoder: ``UMT5EncoderModel``, 2 layers x 64, trained jointly with the transformer; T5
  tokenizer (Unigram) trained in-process on the train captions.
- transformer: ``WanTransformer3DModel``, patch (1, 2, 2): a 64 px frame is 8x8x16 latents = 16
  tokens, a 9-frame clip 144.
- scheduler: Wan 2.1's ``UniPCMultistepScheduler`` (flow sigmas, shift 3) in every training export;
  ``python -m training.video_model --model DIR --sampler euler`` rewrites a directory's
  (:func:`set_sampler`).
"""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path

import torch

from shapeworld.video import CLIP_CAPTION_STYLES, CLIP_FRAMES, clip_caption, iter_all_clips

IMAGE_VAE = Path(__file__).resolve().parent.parent / "triptych" / "assets" / "default" / "vae"
#: Prompt embeddings are zero-padded to this many tokens (WanPipeline pads to ``max_sequence_length``
#: and the transformer attends to the padding, so training and inference must use the same length;
#: the family adapter reads it from ``triptych.json``; plain diffusers callers pass it).
MAX_SEQUENCE_LENGTH = 32
#: ``world``: "shapes-video" (not "shapes": ``triptych quality`` scores image prompts for "shapes").
DEFAULTS = {
    "height": 64,
    "width": 64,
    "frames": CLIP_FRAMES,
    "steps": 20,
    # Chosen on 32 clips of train combinations (``evaluate_video --split train``), phase 4's weights:
    # shape kind right on 22% / 53% / 62% / 56% / 47% / 38% / 22% of videos at guidance
    # 1 / 1.5 / 2 / 2.5 / 3 / 4 / 6 (direction, colour and background 100% at every one).
    "guidance": 2.0,
    "max_sequence_length": MAX_SEQUENCE_LENGTH,
    "world": "shapes-video",
    "trained_sizes": ["64x64"],  # other sizes get a warning (``triptych.families.geometry``)
}
DIMS = dict(layers=4, heads=3, head_dim=32, ffn=384, text_dim=64, text_layers=2, text_heads=4, text_ff=128)


def frame_independent(vae) -> int:
    """Zero every causal 3-D convolution's taps on past frames (keep the current-frame tap);
    returns how many convolutions had such taps."""
    n = 0
    with torch.no_grad():
        for module in vae.modules():
            if type(module).__name__ == "WanCausalConv3d" and module.weight.shape[2] > 1:
                module.weight[:, :, :-1] = 0
                n += 1
    return n


def video_vae(image_vae_dir: Path = IMAGE_VAE):
    """The image VAE's weights in ``AutoencoderKLWan`` (frame by frame, see the module docstring)."""
    from diffusers import AutoencoderKLQwenImage, AutoencoderKLWan

    image = AutoencoderKLQwenImage.from_pretrained(image_vae_dir)
    cfg = image.config
    vae = AutoencoderKLWan(
        base_dim=cfg.base_dim,
        z_dim=cfg.z_dim,
        dim_mult=list(cfg.dim_mult),
        num_res_blocks=cfg.num_res_blocks,
        attn_scales=list(cfg.attn_scales),
        temperal_downsample=[False, False, False],
        dropout=cfg.dropout,
        latents_mean=list(cfg.latents_mean),
        latents_std=list(cfg.latents_std),
        scale_factor_temporal=1,
        scale_factor_spatial=2 ** (len(cfg.dim_mult) - 1),
    )
    vae.load_state_dict(image.state_dict(), strict=True)
    frame_independent(vae)
    return vae.eval()


def tokenizer_corpus() -> list[str]:
    return [clip_caption(c, s) for c in iter_all_clips("train") for s in CLIP_CAPTION_STYLES]


@cache
def tokenizer():
    from triptych.families.tiny.tokenizers import train_t5_tokenizer

    return train_t5_tokenizer(vocab_size=400, extra_corpus=tokenizer_corpus(), model_max_length=MAX_SEQUENCE_LENGTH)


def text_encoder(seed: int):
    from transformers import UMT5Config, UMT5EncoderModel

    tok = tokenizer()
    torch.manual_seed(seed + 1)
    return UMT5EncoderModel(
        UMT5Config(
            d_model=DIMS["text_dim"],
            d_kv=DIMS["text_dim"] // DIMS["text_heads"],
            num_heads=DIMS["text_heads"],
            num_layers=DIMS["text_layers"],
            d_ff=DIMS["text_ff"],
            dropout_rate=0.0,
            vocab_size=len(tok),
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            decoder_start_token_id=0,
        )
    )


def transformer(seed: int):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=DIMS["heads"],
        attention_head_dim=DIMS["head_dim"],
        in_channels=16,
        out_channels=16,
        text_dim=DIMS["text_dim"],
        freq_dim=256,
        ffn_dim=DIMS["ffn"],
        num_layers=DIMS["layers"],
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
    )


def scheduler(sampler: str = "unipc"):
    """The sampler a video model is written with. ``unipc``: Wan 2.1's shipped scheduler config (as
    the family's tiny builder writes it), every training export's. ``euler``: diffusers'
    ``FlowMatchEulerDiscreteScheduler`` with the same shift 3, first order, on its own sigmas (at 20
    steps its last two are 0.15 -> 0.009 -> 0 where UniPC's are 0.25 -> 0.14 -> 0); the shipped
    model's, chosen on clips of train combinations (see the model card)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    if sampler == "euler":
        return FlowMatchEulerDiscreteScheduler(shift=3.0, num_train_timesteps=1000)
    if sampler != "unipc":
        raise ValueError(f"sampler {sampler!r}: expected one of {SAMPLERS}")
    return UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, num_train_timesteps=1000
    )


SAMPLERS = ("unipc", "euler")


def set_sampler(model_dir: Path, sampler: str) -> None:
    """Rewrite a video model directory's ``scheduler/`` (and its ``model_index.json`` entry)."""
    new = scheduler(sampler)
    index = json.loads((Path(model_dir) / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", type(new).__name__]
    shutil.rmtree(Path(model_dir) / "scheduler")
    new.save_pretrained(Path(model_dir) / "scheduler")
    (Path(model_dir) / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def components(seed: int) -> dict:
    """Untrained components (the starting point and the random-weight twin); the VAE is trained."""
    return dict(
        vae=video_vae(),
        text_encoder=text_encoder(seed),
        tokenizer=tokenizer(),
        transformer=transformer(seed),
        scheduler=scheduler(),
    )


def warm_start(parts: dict, init: Path) -> int:
    """Load a trained video model's transformer and text encoder (directory ``init``) into ``parts``.
    The tokenizers may differ (the captions changed): the token embedding rows are copied piece by
    piece for the pieces both vocabularies hold, the other rows keep their fresh initialisation.
    Returns how many rows were copied."""
    from diffusers import WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5EncoderModel

    init = Path(init)
    parts["transformer"].load_state_dict(WanTransformer3DModel.from_pretrained(init / "transformer").state_dict())
    old = UMT5EncoderModel.from_pretrained(init / "text_encoder").state_dict()
    old_vocab = AutoTokenizer.from_pretrained(init / "tokenizer").get_vocab()
    state = parts["text_encoder"].state_dict()
    table = state["shared.weight"].clone()
    pairs = [(i, old_vocab[piece]) for piece, i in parts["tokenizer"].get_vocab().items() if piece in old_vocab]
    for new, was in pairs:
        table[new] = old["shared.weight"][was]
    state.update({k: v for k, v in old.items() if k in state and v.shape == state[k].shape})
    state["shared.weight"] = state["encoder.embed_tokens.weight"] = table
    parts["text_encoder"].load_state_dict(state)
    return len(pairs)


def pipeline(parts: dict):
    from diffusers import WanPipeline

    return WanPipeline(**{k: parts[k] for k in ("vae", "text_encoder", "tokenizer", "transformer", "scheduler")})


def write_model(parts: dict, out: Path, defaults: dict | None = None) -> Path:
    """A ``WanPipeline`` directory plus ``triptych.json``."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    pipeline(parts).save_pretrained(out)
    (out / "triptych.json").write_text(json.dumps(defaults or DEFAULTS, indent=2) + "\n")
    return out


def random_model(out: Path, seed: int, defaults: dict | None = None, like: Path | None = None) -> Path:
    """The same architecture, tokenizer, VAE and settings with untrained text encoder and transformer;
    ``like``: the trained video model directory whose VAE and sampler to take (default: the image
    VAE's weights and ``unipc``)."""
    parts = components(seed)
    if like is not None:
        import diffusers

        parts["vae"] = diffusers.AutoencoderKLWan.from_pretrained(Path(like) / "vae").eval()
        kind = json.loads((Path(like) / "model_index.json").read_text())["scheduler"][1]
        parts["scheduler"] = getattr(diffusers, kind).from_pretrained(Path(like) / "scheduler")
    return write_model(parts, out, defaults)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m training.video_model", description="set a video model's sampler")
    p.add_argument("--model", type=Path, required=True, help="a video model directory (WanPipeline)")
    p.add_argument("--sampler", choices=SAMPLERS, required=True)
    args = p.parse_args(argv)
    set_sampler(args.model, args.sampler)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
