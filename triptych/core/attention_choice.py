"""``--attention auto``: the attention backend (diffusers' attention dispatch) picked per device.

``candidates`` is the preference order for a device description, best first, each with its reason;
``choose`` takes the first one ``usable`` accepts (``core/devices.check_attention``'s probe: the
package installed and one attention call run on the device in the dtype). The order:

- not CUDA, or float32 (the flash kernels take bf16/fp16 only): native (torch SDPA);
- a model that passes attention masks (Qwen-Image's text padding when prompt lengths differ): native,
  since the flash backends take no mask;
- Hopper (compute capability 9.x): flash attention 3, then cuDNN attention, then flash attention 2;
- Blackwell and later (10.x+): cuDNN attention, then flash attention 2 (flash attention 3 is Hopper's);
- Ampere and Ada (8.x): flash attention 2;
- native last, always (every device torch runs).

Standard library only: the choice is plain logic over a description (tests give it fake devices).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

NATIVE = "native"


@dataclass(frozen=True)
class AttentionDevice:
    """What the choice reads of a device."""

    type: str  # "cuda", "cpu", ...
    dtype: str  # "bfloat16", "float16", "float32"
    capability: tuple[int, int] | None = None  # CUDA compute capability (major, minor)
    name: str = ""  # the device's name, for the log line


def candidates(device: AttentionDevice, masks: bool = False) -> list[tuple[str, str]]:
    """(backend, reason) in preference order for ``device``, ``native`` last."""
    native = (NATIVE, "torch scaled_dot_product_attention (every device)")
    if device.type != "cuda" or device.capability is None:
        return [(NATIVE, f"torch scaled_dot_product_attention: the backend for {device.type}")]
    if device.dtype not in ("bfloat16", "float16"):
        return [(NATIVE, f"the flash kernels take bf16/fp16, not {device.dtype}")]
    if masks:
        return [(NATIVE, "the model passes attention masks, which the flash backends do not take")]
    major = device.capability[0]
    if major == 9:
        return [
            ("_flash_3", "flash attention 3: Hopper's kernel"),
            ("_native_cudnn", "cuDNN attention on Hopper"),
            ("flash", "flash attention 2"),
            native,
        ]
    if major >= 10:
        return [("_native_cudnn", "cuDNN attention on Blackwell"), ("flash", "flash attention 2"), native]
    if major == 8:
        return [("flash", "flash attention 2 on Ampere/Ada"), native]
    return [(NATIVE, f"compute capability {major}.x has no flash kernel")]


def choose(device: AttentionDevice, usable: Callable[[str], bool], masks: bool = False) -> tuple[str, str]:
    """The first of ``candidates`` that ``usable`` accepts (``native`` is never probed), and why."""
    skipped = []
    for backend, reason in candidates(device, masks):
        if backend == NATIVE or usable(backend):
            if skipped:
                reason = f"{reason} ({', '.join(skipped)} not usable here)"
            return backend, reason
        skipped.append(backend)
    raise AssertionError("candidates always end with native")


def describe(device: str, dtype: str) -> AttentionDevice:
    """The description of ``device`` (a name such as ``cuda:0``) running ``dtype``."""
    if not device.startswith("cuda"):
        return AttentionDevice(device.split(":")[0], dtype)
    import torch

    return AttentionDevice(
        "cuda", dtype, tuple(torch.cuda.get_device_capability(device)), torch.cuda.get_device_name(device)
    )
