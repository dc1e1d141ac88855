"""Untrained components of the default model's architecture, built with the Qwen-Image family's builders."""

from __future__ import annotations

from functools import cache

from training import data
from training.common import CHAT_TEMPLATE, VLM_PIXELS, dims


@cache
def tokenizer():
    from triptych.families.qwenimage.tokenizer import train_qwen_tokenizer

    tok = train_qwen_tokenizer(vocab_size=dims().vocab_size, extra_corpus=data.tokenizer_corpus())
    tok.chat_template = CHAT_TEMPLATE
    return tok


def processor(tok=None):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from triptych.families.qwenimage.processor import QwenImageEditProcessor

    image_processor = Qwen2VLImageProcessorPil(min_pixels=VLM_PIXELS, max_pixels=VLM_PIXELS)
    return QwenImageEditProcessor(
        image_processor=image_processor, tokenizer=tok or tokenizer(), chat_template=CHAT_TEMPLATE
    )


def components(seed: int, edit: bool = False) -> dict:
    """Seeded untrained pipeline components (the random-weight baseline and the starting point)."""
    from training.train_vae import build_vae
    from triptych.families.qwenimage.tiny import _text_encoder, build_components

    parts = build_components(dims(), seed, edit=False, extra_corpus=data.tokenizer_corpus())
    tok = tokenizer()
    import torch

    torch.manual_seed(seed + 1)
    parts["text_encoder"] = _text_encoder(dims(), tok)
    parts["tokenizer"] = tok
    parts["vae"] = build_vae(seed)
    if edit:
        parts["processor"] = processor(tok)
    return parts


def text_encoder(seed: int):
    import torch

    from triptych.families.qwenimage.tiny import _text_encoder

    torch.manual_seed(seed + 1)
    return _text_encoder(dims(), tokenizer())
