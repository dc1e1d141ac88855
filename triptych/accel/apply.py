"""Apply a ``SpeedConfig`` to a loaded pipeline, and the startup checks that refuse what cannot run."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from triptych.accel.config import SpeedConfig
from triptych.core.errors import InvalidParam

logger = logging.getLogger(__name__)

#: Compute capability fp8 matmuls need (torchao's float8 dynamic quantization: Ada, Hopper, later).
FP8_CAPABILITY = (8, 9)


def check_speed(config: SpeedConfig, device: str = "cpu") -> None:
    """Raise ``InvalidParam`` naming the flag, before anything loads, for a setting that cannot run:
    torchao missing, fp8 off CUDA or on a GPU without fp8 matmuls. A multi-rank denoiser takes both
    flags: rank 0 sends them to its followers (``worker/ranks/ticks.RankSetup``)."""
    if config.cuda_graphs and not config.compile:
        raise InvalidParam("--cuda-graphs", "on", "needs --compile: the CUDA graphs are the compiled block stack's")
    if config.cuda_graphs and not device.startswith("cuda"):
        raise InvalidParam("--cuda-graphs", "on", f"needs a CUDA device; this is {device}")
    if config.step_graphs and config.cuda_graphs:
        raise InvalidParam(
            "--step-graphs", "on", "--cuda-graphs records the compiled block stack instead: pick one of the two"
        )
    if config.step_graphs and not device.startswith("cuda"):
        raise InvalidParam("--step-graphs", "on", f"needs a CUDA device; this is {device}")
    for component, mode in config.quantized.items():
        if mode != "fp8":
            continue
        if not device.startswith("cuda"):
            raise InvalidParam(
                "--quantize",
                f"{component}={mode}",
                f"fp8 needs a CUDA device (compute capability >= 8.9); this is {device}",
            )
        import torch

        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_CAPABILITY:
            raise InvalidParam(
                "--quantize", f"{component}={mode}", f"fp8 needs compute capability >= 8.9; {device} has {capability}"
            )
    if config.quantize and importlib.util.find_spec("torchao") is None:
        raise InvalidParam("--quantize", ",".join(config.quantize), "needs torchao: pip install 'triptych[quant]'")


def apply_speed(pipe, config: SpeedConfig, device: str = "cpu", compile_vae_decoder: bool = False):
    """Quantize the named components the pipeline has loaded, then compile its transformer's blocks
    and, with ``compile_vae_decoder`` (the family's ``compile_vae_decoder``), its VAE decoder.
    Returns the compiled one-frame decoder ``compile_decoder`` made, or None."""
    if not config.active:
        return None
    check_speed(config, device)
    for component, mode in config.quantized.items():
        module = getattr(pipe, component, None)
        if module is None:  # another role's component: not loaded here
            continue
        from triptych.accel.quantize import quantize_component

        quantize_component(module, mode)
    if not config.compile:
        return None
    from triptych.accel.compile import compile_decoder, compile_repeated_blocks, set_cache_dir

    if config.compile_cache_dir is not None:  # None: inductor's own default (the CLIs always set one)
        set_cache_dir(Path(config.compile_cache_dir))
    transformer, vae = getattr(pipe, "transformer", None), getattr(pipe, "vae", None)
    if transformer is not None:
        compile_repeated_blocks(transformer)
    if compile_vae_decoder and vae is not None:
        return compile_decoder(vae, device)
    return None
