"""Qwen2.5-VL processor for Qwen-Image-Edit without torchvision.

``Qwen2VLProcessor`` always builds a video processor, which needs torchvision (not installed here:
it would pull another torch). Qwen-Image-Edit only ever passes images, so this subclass drops the
video processor and uses the PIL image processor. ``load_processor`` builds it from the files of any
checkpoint's ``processor/`` folder (real Qwen-Image-Edit or a tiny one written by ``tiny.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, Qwen2VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

#: Qwen2-VL / Qwen2.5-VL chat template (as in the released checkpoints): what the tiny builders
#: write, so tiny models chat like real ones.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_template_of(processor_dir: str | Path) -> str | None:
    """The chat template a checkpoint's ``processor/`` carries (``chat_template.jinja``, the older
    ``chat_template.json``, or its tokenizer config's), None without one."""
    root = Path(processor_dir)
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text()
    for name, key in (("chat_template.json", "chat_template"), ("tokenizer_config.json", "chat_template")):
        if (root / name).is_file():
            value = json.loads((root / name).read_text()).get(key)
            if isinstance(value, str):
                return value
    return None


class QwenImageEditProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` with image processor and tokenizer only (no video processor)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def load_processor(processor_dir: str | Path) -> QwenImageEditProcessor:
    """Build the processor from a checkpoint's ``processor/`` files, whatever class they declare."""
    template = chat_template_of(processor_dir)
    processor_dir = str(processor_dir)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(processor_dir)
    tokenizer = AutoTokenizer.from_pretrained(processor_dir)
    return QwenImageEditProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=template)
