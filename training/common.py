"""Shared pieces of the training stages: model sizes, seeding, checkpoints, CPU speed-ups."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from triptych.families.qwenimage.processor import CHAT_TEMPLATE  # noqa: F401  (the captioner's template)

logger = logging.getLogger("training")

IMAGE_SIZE = 64
#: Edit condition images are VAE-encoded at this many pixels (the edit model's ``condition_area``):
#: the world's own 64 px, 16 condition tokens, instead of QwenImageEditPipeline's 1 MP (1,024 tokens).
CONDITION_AREA = IMAGE_SIZE * IMAGE_SIZE
#: The captioner's edit-template examples were rendered at the pipeline's 1 MP (how the shipped text
#: encoder was trained, before the default model moved to ``CONDITION_AREA``).
VLM_EDIT_AREA = 1024 * 1024
#: Qwen2.5-VL input images are resized to exactly this many pixels (112 x 112 → 16 vision tokens).
VLM_PIXELS = 112 * 112
CAPTION_QUESTION = "What is in this image?"
DEFAULT_SYSTEM = "You are a helpful assistant."


def dims():
    """Sizes of the default model (see MODEL_CARD.md): 8x VAE, a 64 px image is an 8x8x16 latent = 16 tokens."""
    from triptych.families.qwenimage.tiny import QwenImageDims

    return QwenImageDims(
        layers=6,
        heads=3,
        head_dim=32,
        rope_axes=(8, 12, 12),
        z_dim=16,
        vae_base_dim=16,
        vae_dim_mult=(1, 2, 2, 4),
        text_dim=64,
        text_layers=2,
        text_heads=2,
        text_mlp=128,
        vision_dim=32,
        vision_layers=2,
        vision_heads=2,
        image_max_pixels=VLM_PIXELS,
        vocab_size=1000,
    )


def setup(seed: int, threads: int = 1) -> None:
    """Deterministic CPU training. One thread by default: on a shared 2-core machine a second
    thread spin-waits and made steps 10-30x slower in measurements (and results depend on it)."""
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    seed_all(seed)


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(path: Path, **state: Any) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    return torch.load(path, weights_only=False)


def resume_from(path: Path, resume: bool, model, opt, pyrng=None) -> tuple[int, dict[str, Any] | None]:
    """Restore model, optimiser, torch RNG (and ``pyrng``, a ``random.Random``) from ``path`` when
    ``resume`` and the checkpoint exists; returns (step to start at, the checkpoint or None)."""
    state = load_checkpoint(path) if resume else None
    if not state:
        return 0, None
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    set_rng_state(state["rng"])
    if pyrng is not None:
        pyrng.setstate(state["pyrng"])
    return state["step"], state


def cosine_lr(step: int, total: int, base: float, warmup: int = 50) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base * (0.05 + 0.95 * 0.5 * (1 + np.cos(np.pi * min(1.0, progress))))


class Timer:
    def __init__(self):
        self.start = time.time()

    def __call__(self) -> float:
        return time.time() - self.start


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


def update_json(path: Path, extra: dict[str, Any]) -> None:
    """Add ``extra``'s keys to the JSON object in ``path`` (same layout as ``write_json``)."""
    write_json(path, {**json.loads(path.read_text()), **extra})


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tree_sha256(root: Path, pattern: str = "*.safetensors") -> dict[str, str]:
    return {str(p.relative_to(root)): file_sha256(p) for p in sorted(Path(root).rglob(pattern))}


@contextlib.contextmanager
def single_frame_convs():
    """Run the Qwen-Image VAE's causal 3-D convolutions as 2-D ones on single-frame inputs.

    A causal conv on one frame sees two zero frames of padding plus the frame itself, so only the
    kernel's last time tap contributes: ``conv2d`` with that tap is the same function (and the same
    gradient for that tap) at a third of the cost. Used for training and for precomputing latents;
    the shipped model runs the unmodified diffusers code.
    """
    import torch.nn.functional as F
    from diffusers.models.autoencoders import autoencoder_kl_qwenimage as m

    original = m.QwenImageCausalConv3d.forward

    def forward(self, x, cache_x=None):
        if x.shape[2] != 1 or cache_x is not None:
            return original(self, x, cache_x)
        pad_h, pad_w = self._padding[2], self._padding[0]
        y = F.pad(x[:, :, 0], (pad_w, self._padding[1], pad_h, self._padding[3]))
        y = F.conv2d(y, self.weight[:, :, -1], self.bias, self.stride[1:], 0, self.dilation[1:], self.groups)
        return y.unsqueeze(2)

    m.QwenImageCausalConv3d.forward = forward
    try:
        yield
    finally:
        m.QwenImageCausalConv3d.forward = original
