"""Put a loaded diffusers pipeline on its device as a ``DeviceConfig`` says (generic over families).

``place`` runs once at load time: device (or offload hooks), attention backend, VAE slicing.
``vae_tiling`` is per decode: the decoder turns tiling on for a large frame and off again after, so one
decoder instance serves 64² and 2048² requests, each the way its size needs.
"""

from __future__ import annotations

import contextlib
import inspect
import logging

import torch

from triptych.core.devices import DeviceConfig

logger = logging.getLogger(__name__)


def place(pipe, config: DeviceConfig, masks: bool = False) -> None:
    """Move ``pipe``'s loaded components to ``config.device`` (or install offload hooks), set the
    transformer's attention backend (``masks``: its model passes attention masks, for ``auto``) and
    the VAE's slicing."""
    device = config.torch_device
    if config.offload == "model":
        pipe.enable_model_cpu_offload(device=device)
    elif config.offload == "group":
        group_offload(pipe, device)
    else:
        pipe.to(device)
    transformer = getattr(pipe, "transformer", None)
    attention = config.attention_backend(masks)
    if transformer is not None:
        # NOTE: also sets diffusers' process-wide active backend; every transformer of a process
        # shares one DeviceConfig, so that is the same choice.
        transformer.set_attention_backend(attention)
    vae = getattr(pipe, "vae", None)
    if vae is not None and config.vae_slicing and hasattr(vae, "enable_slicing"):
        vae.enable_slicing()
    logger.debug("placed %s on %s (%s, attention %s)", type(pipe).__name__, device, config.dtype_name, attention)


def group_offload(pipe, onload_device: torch.device, offload_device: torch.device = torch.device("cpu")) -> None:
    """diffusers group offload, one transformer block per group, CUDA streams when onloading to CUDA.

    Weights stay in (pinned, with streams) host memory and each block group is copied in just before
    it runs. Split from ``place`` so a CPU test can run the hooks with ``onload_device=cpu``.
    """
    stream = onload_device.type == "cuda"
    pipe.enable_group_offload(
        onload_device=onload_device,
        offload_device=offload_device,
        offload_type="block_level",
        num_blocks_per_group=1,
        use_stream=stream,
        non_blocking=stream,
    )


#: Tile edge and stride (pixels) for VAEs whose ``enable_tiling`` takes sizes (Qwen-Image, Wan). Larger than
#: diffusers' default 256/192: fewer, larger tiles overlap less, at about the same memory peak
#: (benchmarks/decode_memory.py, benchmarks/RESULTS.md).
TILE, TILE_STRIDE = 512, 448


def enable_vae_tiling(vae) -> None:
    if "tile_sample_min_height" in inspect.signature(vae.enable_tiling).parameters:
        vae.enable_tiling(
            tile_sample_min_height=TILE,
            tile_sample_min_width=TILE,
            tile_sample_stride_height=TILE_STRIDE,
            tile_sample_stride_width=TILE_STRIDE,
        )
    else:  # AutoencoderKL (FLUX): tiles of its config's sample_size
        vae.enable_tiling()


@contextlib.contextmanager
def vae_tiling(vae, on: bool):
    """Run the body with the VAE's tiling ``on`` or off, restoring what it was."""
    if vae is None or not hasattr(vae, "enable_tiling"):
        yield
        return
    before = bool(getattr(vae, "use_tiling", False))
    if on != before:
        enable_vae_tiling(vae) if on else vae.disable_tiling()
    try:
        yield
    finally:
        if on != before:
            enable_vae_tiling(vae) if before else vae.disable_tiling()
