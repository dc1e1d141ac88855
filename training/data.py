"""The shape world as tensors: images, prompts, VLM inputs and edit pairs for training."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable
from functools import cache, lru_cache

import numpy as np
import torch
from PIL import Image

from shapeworld import (
    ATTRIBUTES,
    COLOR_NAMES,
    POSITIONS,
    SHAPES,
    SIZES,
    EditPair,
    Scene,
    caption,
    iter_all_scenes,
    make_edit,
)
from shapeworld.edits import TEMPLATES
from training.common import CAPTION_QUESTION, IMAGE_SIZE

_VALUES = {"shape": SHAPES, "color": COLOR_NAMES, "background": COLOR_NAMES, "position": POSITIONS, "size": SIZES}


@cache
def train_scenes() -> tuple[Scene, ...]:
    return tuple(iter_all_scenes("train"))


@lru_cache(maxsize=8192)
def image(scene: Scene) -> Image.Image:
    from shapeworld import render

    return render(scene, IMAGE_SIZE)


def pixels(scenes: Iterable[Scene]) -> torch.Tensor:
    """(B, 3, 1, H, W) in [-1, 1], the VAE's input layout."""
    arr = np.stack([np.asarray(image(s), dtype=np.float32) for s in scenes]) / 127.5 - 1.0
    return torch.from_numpy(arr).permute(0, 3, 1, 2).unsqueeze(2).contiguous()


def shape_mask(pixels: torch.Tensor) -> torch.Tensor:
    """1.0 where a pixel differs from the image's top-left (background) pixel; channels on dim 1,
    height and width last, (B, 3, H, W) or the VAE's (B, 3, 1, H, W)."""
    return ((pixels - pixels[..., :1, :1]).abs().sum(1, keepdim=True) > 0.05).float()


def contrast(pixels: torch.Tensor) -> torch.Tensor:
    """``(N,)``: each image's mean squared difference over RGB between its shape's colour and its
    background, pixels as :func:`shape_mask` takes them (what a pixel drawn in the wrong one of the
    two colours costs an L2 loss)."""
    mask = shape_mask(pixels)
    dims = tuple(range(2, pixels.dim()))
    shape = (pixels * mask).sum(dims, keepdim=True) / mask.sum(dims, keepdim=True).clamp(min=1)
    return (shape - pixels[..., :1, :1]).pow(2).flatten(1).mean(1)


def prompt_for(scene: Scene, style: str) -> str:
    return caption(scene, style)


def all_prompts(scenes: Iterable[Scene]) -> list[str]:
    out: dict[str, None] = {}
    for s in scenes:
        for style in ("short", "long", "tag"):
            out[prompt_for(s, style)] = None
    return list(out)


def edits_of(source: Scene) -> list[EditPair]:
    """Every single-attribute edit of ``source`` (all instruction variants) whose target is a train scene."""
    pairs = []
    for attribute in ATTRIBUTES:
        for value in _VALUES[attribute]:
            if value == getattr(source, attribute):
                continue
            for variant in range(len(TEMPLATES[attribute])):
                try:
                    pair = make_edit(source, attribute, value, variant)
                except ValueError:
                    continue
                if pair.target.split == "train":
                    pairs.append(pair)
    return pairs


def sample_edit_sources(k: int, seed: int) -> list[Scene]:
    """``k`` train scenes covering every shape, colour, background, position and size."""
    rng = random.Random(f"{seed}|edit-sources")
    scenes = list(train_scenes())
    rng.shuffle(scenes)
    return scenes[:k]


def tokenizer_corpus() -> list[str]:
    """Texts the BPE is trained on (train-split captions, instructions, the caption question)."""
    from training.common import DEFAULT_SYSTEM

    texts = all_prompts(train_scenes())
    for attribute, templates in TEMPLATES.items():
        for t in templates:
            for shape in SHAPES:
                for new in (*_VALUES[attribute], "bigger", "smaller"):
                    texts.append(t.format(shape=shape, new=new))
    texts += [CAPTION_QUESTION, DEFAULT_SYSTEM, "Describe the image."]
    return texts


def caption_answer(scene: Scene) -> str:
    """What the captioner is trained to answer: the long caption."""
    return caption(scene, "long")


def rescale_like_edit_pipeline(img: Image.Image, area: int) -> Image.Image:
    """The condition image as the edit family sees it: resized to ~``area`` pixels (lanczos)."""
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    w, h, _ = calculate_dimensions(area, img.size[0] / img.size[1])
    return VaeImageProcessor(vae_scale_factor=16).resize(img, h, w)


def replace(scene: Scene, **changes) -> Scene:
    return dataclasses.replace(scene, **changes)
