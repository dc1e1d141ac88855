"""Train a style LoRA for the default model's transformer (base frozen), diffusers format.

``python -m training.train_lora --style invert --out DIR [--steps 600 --rank 8]``

Same data and objective as the base transformer (``train_dit``): targets are VAE posterior means,
normalised and packed as ``QwenImagePipeline`` unpacks them; conditions are the pipeline's own
``_get_qwen_prompt_embeds`` of the train split's captions (short/long/tag as ``train_dit`` draws
them), 10% replaced by the negative prompt " " so true CFG keeps working; rectified-flow loss
(``dit_objective.flow_loss``) with the base's last-phase settings (shape tokens weighted 4x, a
third of noise levels from [0.8, 1]).  The one change: the target image is the *styled* render of the
caption's scene (:func:`shapeworld.styles.style_scene`).  The adapter is a PEFT LoRA on every
attention and MLP Linear of the transformer blocks, saved with ``QwenImagePipeline.save_lora_weights``
(what ``load_lora_weights`` reads).
"""

from __future__ import annotations

import argparse
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shapeworld.styles import STYLES as WORLD_STYLES
from shapeworld.styles import style_scene
from training import data
from training.common import Timer, cosine_lr, seed_all, single_frame_convs
from training.dit_objective import _pad, flow_loss, token_foreground
from training.train_dit import CFG_DROP, NEGATIVE, STYLE_P, STYLES, _normalised_latents, _split

logger = logging.getLogger("training.lora")
DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "triptych" / "assets" / "default"
TARGET_MODULES = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
)


@dataclass
class LoraTrainConfig:
    style: str
    out: Path
    model: Path = DEFAULT_MODEL
    steps: int = 600
    batch: int = 32
    rank: int = 8
    lr: float = 1e-3
    scenes: int = 800  # train scenes sampled for the data (all 2,016 work; this keeps precompute cheap)
    fg: float = 4.0  # loss weight of image tokens on the shape (train_dit phases 3-7)
    high: float = 1 / 3  # share of noise levels drawn from [0.8, 1] (train_dit phases 2-7)
    seed: int = 0
    threads: int = 1  # two threads on the shared 2-core box ran ~10x slower per step


@torch.no_grad()
def precompute(cfg: LoraTrainConfig, pipe) -> dict:
    """Styled target latents and prompt embeddings of ``cfg.scenes`` train scenes."""
    timer = Timer()
    scenes = list(data.train_scenes())
    random.Random(f"{cfg.seed}|lora-scenes").shuffle(scenes)
    scenes = scenes[: cfg.scenes]
    with single_frame_convs():
        lat = _normalised_latents(pipe.vae, [style_scene(s, cfg.style) for s in scenes])
    c, h, w = lat.shape[1], lat.shape[3], lat.shape[4]
    x0 = pipe._pack_latents(lat, lat.shape[0], c, h, w)
    prompts = data.all_prompts(scenes) + [NEGATIVE]
    embeds: list[torch.Tensor] = []
    for i in range(0, len(prompts), 64):
        e, m = pipe._get_qwen_prompt_embeds(prompt=prompts[i : i + 64], device=torch.device("cpu"))
        embeds += _split(e, m)
    index = {p: i for i, p in enumerate(prompts)}
    table = np.array([[index[data.prompt_for(s, st)] for st in STYLES] for s in scenes])
    logger.info("lora: %d styled targets, %d prompts (%.0fs)", len(scenes), len(prompts), timer())
    fg = token_foreground([style_scene(s, cfg.style) for s in scenes])
    return {
        "fg": fg,
        "x0": x0,
        "embeds": embeds,
        "table": table,
        "negative": index[NEGATIVE],
        "shapes": (1, h // 2, w // 2),
    }


def add_lora(transformer, rank: int) -> None:
    from peft import LoraConfig

    transformer.requires_grad_(False)
    transformer.add_adapter(
        LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=list(TARGET_MODULES))
    )


def train(cfg: LoraTrainConfig) -> Path:
    from diffusers import QwenImagePipeline
    from peft.utils import get_peft_model_state_dict

    if cfg.style not in WORLD_STYLES:
        raise ValueError(f"style {cfg.style!r} is not one of {WORLD_STYLES}")
    torch.set_num_threads(cfg.threads)
    seed_all(cfg.seed)
    pipe = QwenImagePipeline.from_pretrained(cfg.model)
    d = precompute(cfg, pipe)
    model = pipe.transformer
    add_lora(model, cfg.rank)
    params = [p for p in model.parameters() if p.requires_grad]
    logger.info("lora: rank %d, %d trainable parameters", cfg.rank, sum(p.numel() for p in params))
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.99))
    rng = random.Random(f"{cfg.seed}|lora-batches")
    gen = torch.Generator().manual_seed(cfg.seed)
    n, timer = len(d["x0"]), Timer()
    model.train()
    for step in range(cfg.steps):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, cfg.steps, cfg.lr, warmup=50)
        idx = [rng.randrange(n) for _ in range(cfg.batch)]
        cols = rng.choices(range(len(STYLES)), weights=STYLE_P, k=cfg.batch)
        rows = [d["negative"] if rng.random() < CFG_DROP else int(d["table"][i, c]) for i, c in zip(idx, cols)]
        embeds, mask = _pad([d["embeds"][r] for r in rows])
        weight = 1.0 + (cfg.fg - 1.0) * d["fg"][idx]
        loss = flow_loss(model, d["x0"][idx], embeds, mask, d["shapes"], gen, high=cfg.high, weight=weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == cfg.steps - 1:
            logger.info("lora %s step %d/%d loss %.4f (%.0fs)", cfg.style, step, cfg.steps, loss.item(), timer())
    model.eval()
    cfg.out.mkdir(parents=True, exist_ok=True)
    QwenImagePipeline.save_lora_weights(cfg.out, transformer_lora_layers=get_peft_model_state_dict(model))
    logger.info("lora: saved %s", cfg.out)
    return cfg.out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--style", required=True, choices=WORLD_STYLES)
    p.add_argument("--out", type=Path, required=True)
    for name in ("model", "steps", "batch", "rank", "lr", "scenes", "fg", "high", "seed", "threads"):
        default = getattr(LoraTrainConfig, name)
        p.add_argument(f"--{name}", type=type(default), default=default)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    train(LoraTrainConfig(**vars(args)))


if __name__ == "__main__":
    main()
