"""Peak host memory of one decode: the decoder stage alone, in a fresh process, per size and tiling.

    python benchmarks/decode_memory.py [--model DIR] [--size 2048] [--tiling auto|on|off]

Prints one JSON line: the process's peak RSS (``ru_maxrss``) after loading, after the decode, the
difference, and the seconds the decode took. A fresh process per measurement, because ru_maxrss only
grows. tests/pipelines/test_vae_memory.py runs it as a subprocess.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def measure(model: str | None, size: int, tiling: str, device: str = "cpu") -> dict:
    import torch

    from triptych.core.devices import DeviceConfig
    from triptych.families.base import GenerationParams, Role
    from triptych.families.models import resolve_model
    from triptych.families.registry import load_family

    config = DeviceConfig(device=device, vae_tiling={"auto": None, "on": True, "off": False}[tiling])
    family = load_family(resolve_model(model), roles={Role.DECODER}, device=config)
    params = family.resolve(GenerationParams(prompt="-", height=size, width=size, steps=2))
    # The denoiser's output layout, packed (1, tokens, channels) or 5-D video.
    latents = _latents_like(family, params, torch.Generator().manual_seed(0))
    loaded = peak_mb()
    t = time.perf_counter()
    frames = family.decode(latents, params)
    seconds = time.perf_counter() - t
    pixels = frames.to_uint8()
    return dict(
        size=size,
        tiling=config.tiling_for(size, size),
        loaded_mb=round(loaded),
        peak_mb=round(peak_mb()),
        decode_mb=round(peak_mb() - loaded),
        seconds=round(seconds, 2),
        frames_shape=list(pixels.shape),
    )


def _latents_like(family, params, generator):
    import torch

    if family.is_video:
        s = family.pipe.vae_scale_factor_spatial
        t = (params.frames - 1) // family.pipe.vae_scale_factor_temporal + 1
        shape = (1, family.latent_channels, t, params.height // s, params.width // s)
        return torch.randn(shape, generator=generator)
    s = family.pipe.vae_scale_factor * 2
    channels = family.pipe.vae.config.get("z_dim", None) or family.pipe.vae.config.latent_channels
    shape = (1, (params.height // s) * (params.width // s), channels * 4)
    return torch.randn(shape, generator=generator).to(family.dtype)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: the built-in model)")
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--tiling", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    print(json.dumps(measure(args.model, args.size, args.tiling)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
