"""Qwen2.5-VL processor for Qwen-Image-Edit without torchvision.

``Qwen2VLProcessor`` always builds a video processor, which needs torchvision (not installed here:
it would pull another torch). Qwen-Image-Edit only ever passes images, so this subclass drops the
video processor and uses the PIL image processor. ``load_processor`` builds it from the files of any
checkpoint's ``processor/`` folder (real Qwen-Image-Edit or a tiny one written by ``tiny.py``).
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, Qwen2VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil


class QwenImageEditProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` with image processor and tokenizer only (no video processor)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def load_processor(processor_dir: str | Path) -> QwenImageEditProcessor:
    """Build the processor from a checkpoint's ``processor/`` files, whatever class they declare."""
    processor_dir = str(processor_dir)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(processor_dir)
    tokenizer = AutoTokenizer.from_pretrained(processor_dir)
    return QwenImageEditProcessor(image_processor=image_processor, tokenizer=tokenizer)
