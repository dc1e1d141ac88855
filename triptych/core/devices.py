"""Where and how a stage runs: device, dtype, attention backend, VAE tiling/slicing, offload.

``DeviceConfig`` is the one config of this subsystem (devices are a
parameter). Every check a user can fail raises ``InvalidParam`` naming the CLI option, the value and
the rule, so ``triptych <command>`` prints one line and exits 2. Capability checks run the real thing
once per process (a tiny matmul and conv in the dtype on the device; one attention call through
diffusers' dispatcher for a backend), so "this machine cannot run it" is found at startup, not in the
middle of a request.

This module imports only the standard library at import time; torch (and, for attention backends,
diffusers) are imported by the checks.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

from triptych.core.config_flags import ConfigFlags, argv_of
from triptych.core.errors import InvalidParam

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")
OFFLOADS = ("none", "model", "group")
AUTO = "auto"  # --attention: chosen per device (``auto_attention``)
#: VAE tiling turns on by itself when one decoded frame has more pixels than this (``vae_tiling=None``).
#: Measured on the default model (the Qwen-Image VAE, float32, CPU): untiled decode peaks far above the
#: tiled one from 1024² up (figures in tests/pipelines/test_vae_memory.py).
AUTO_TILING_PIXELS = 1024 * 1024
_DEVICE_RE = re.compile(r"^(cpu|cuda|cuda:\d+)$")


@dataclass(frozen=True)
class DeviceConfig:
    """How one instance (or one ``triptych generate``) places and runs its components.

    Construction validates everything, probing the machine where it must; an instance holding a
    ``DeviceConfig`` can run it.
    """

    device: str = "cpu"
    """'cpu', 'cuda' (the current CUDA device) or 'cuda:N'. Must exist on this machine."""
    dtype: str | None = None
    """'float32' | 'bfloat16' | 'float16', or None = auto: bfloat16 on CUDA, float32 on CPU. The
    device must run a matmul and a convolution in it. Components load in it (diffusers/transformers
    ``torch_dtype``); families keep the math their diffusers pipeline keeps in float32."""
    attention: str = "auto"
    """diffusers attention backend (``diffusers.models.attention_dispatch.AttentionBackendName``),
    set on the transformer with ``set_attention_backend``; must run on the device in the dtype. auto:
    the best one this device runs (core/attention_choice.py: flash attention 3, cuDNN or flash
    attention 2 on a CUDA device by compute capability, native SDPA elsewhere), logged at load."""
    vae_tiling: bool | None = None
    """Decode (and encode) through the VAE in overlapping tiles. None = auto: on when one frame has
    more than ``AUTO_TILING_PIXELS`` pixels. Tiling changes pixels slightly at tile seams."""
    vae_slicing: bool = False
    """VAE one sample at a time when a batch holds several (diffusers ``enable_slicing``)."""
    offload: str = "none"
    """'none' | 'model' (diffusers ``enable_model_cpu_offload``: each component on the device only
    while it runs) | 'group' (``enable_group_offload``: transformer blocks streamed in, block level).
    Both keep weights in host memory; accelerators only."""

    def __post_init__(self) -> None:
        check_device(self.device)
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InvalidParam("--dtype", self.dtype, f"must be one of {', '.join(DTYPES)} (or omitted: auto)")
        if self.offload not in OFFLOADS:
            raise InvalidParam("--offload", self.offload, f"must be one of {', '.join(OFFLOADS)}")
        if self.offload != "none" and self.device == "cpu":
            raise InvalidParam("--offload", self.offload, "offloads weights to the CPU; it needs a CUDA --device")
        check_dtype(self.device, self.dtype_name)
        if self.attention != AUTO:
            check_attention(self.attention, self.device, self.dtype_name)

    @property
    def dtype_name(self) -> str:
        """The dtype in effect (auto resolved)."""
        if self.dtype is not None:
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def torch_device(self):
        import torch

        return torch.device(self.device)

    def to_args(self) -> list[str]:
        """The ``add_device_flags`` arguments that rebuild this config (a head spawning its workers)."""
        return argv_of(DeviceConfig, self)

    def attention_backend(self, masks: bool = False) -> str:
        """The backend ``attention`` names, ``auto`` resolved for this device and dtype (``masks``: the
        model passes attention masks)."""
        if self.attention != AUTO:
            return self.attention
        return auto_attention(self.device, self.dtype_name, masks)

    def tiling_for(self, height: int, width: int) -> bool:
        """Whether a decode of one ``height`` × ``width`` frame runs tiled."""
        if self.vae_tiling is not None:
            return self.vae_tiling
        return height * width > AUTO_TILING_PIXELS


# ---- checks --------------------------------------------------------------------------------------
def check_device(device: str) -> None:
    """Raise ``InvalidParam('--device', ...)`` unless ``device`` names a device this machine has."""
    if not isinstance(device, str) or not _DEVICE_RE.match(device):
        raise InvalidParam("--device", device, "must be 'cpu', 'cuda' or 'cuda:N'")
    if device == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        raise InvalidParam("--device", device, "CUDA is not available on this machine (torch sees no GPU); use cpu")
    count = torch.cuda.device_count()
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= count:
        raise InvalidParam("--device", device, f"this machine has {count} CUDA device(s): cuda:0..cuda:{count - 1}")


@functools.cache
def check_dtype(device: str, dtype: str) -> None:
    """Raise ``InvalidParam('--dtype', ...)`` unless a tiny matmul and conv run in ``dtype`` on ``device``."""
    import torch

    if dtype not in DTYPES:
        raise InvalidParam("--dtype", dtype, f"must be one of {', '.join(DTYPES)}")
    dt = getattr(torch, dtype)
    try:
        with torch.no_grad():
            x = torch.ones(2, 8, device=device, dtype=dt)
            y = x @ torch.ones(8, 4, device=device, dtype=dt)
            img = torch.ones(1, 2, 4, 4, device=device, dtype=dt)
            z = torch.nn.functional.conv2d(img, torch.ones(2, 2, 3, 3, device=device, dtype=dt), padding=1)
            ok = bool(torch.isfinite(y).all()) and bool(torch.isfinite(z).all())
    except (RuntimeError, TypeError, NotImplementedError) as e:
        raise InvalidParam("--dtype", dtype, f"{device} cannot run it ({_first_line(e)})") from None
    if not ok:
        raise InvalidParam("--dtype", dtype, f"{device} computes non-finite values in it")


def attention_backends() -> list[str]:
    """Backend names diffusers knows, minus hub-kernel backends (they download at first use)."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    return sorted(b.value for b in AttentionBackendName if not b.value.endswith("_hub"))


@functools.cache
def check_attention(name: str, device: str, dtype: str) -> None:
    """Raise ``InvalidParam('--attention', ...)`` unless ``name`` is a backend that runs one attention
    call on ``device`` in ``dtype`` (its package installed, a kernel for the device)."""
    if name == "native":
        return  # torch's scaled_dot_product_attention: every device and dtype torch runs
    valid = attention_backends()
    if name not in valid:
        raise InvalidParam("--attention", name, f"must be one of {', '.join(valid)}")
    import torch
    from diffusers.models.attention_dispatch import (
        AttentionBackendName,
        _check_attention_backend_requirements,
        dispatch_attention_fn,
    )

    backend = AttentionBackendName(name)
    try:
        _check_attention_backend_requirements(backend)
        q = torch.randn(1, 16, 2, 64, device=device, dtype=getattr(torch, dtype))  # (batch, seq, heads, dim)
        out = dispatch_attention_fn(q, q, q, backend=backend)
        ok = bool(torch.isfinite(out).all())
    except Exception as e:  # any failure of the probe means "cannot use it here"
        raise InvalidParam(
            "--attention", name, f"does not run on {device} in {dtype} ({_first_line(e)}); 'native' always does"
        ) from None
    if not ok:
        raise InvalidParam("--attention", name, f"computes non-finite values on {device} in {dtype}")


@functools.cache
def auto_attention(device: str, dtype: str, masks: bool = False) -> str:
    """``--attention auto`` on ``device`` in ``dtype``: the first usable of
    ``attention_choice.candidates`` (each probed by ``check_attention``), logged with its reason."""
    from triptych.core.attention_choice import choose, describe

    def usable(name: str) -> bool:
        try:
            check_attention(name, device, dtype)
        except InvalidParam as e:
            logger.debug("attention %s is not usable: %s", name, e.rule)
            return False
        return True

    described = describe(device, dtype)
    backend, reason = choose(described, usable, masks)
    logger.info("attention auto on %s %s (%s): %s, %s", device, described.name, dtype, backend, reason)
    return backend


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160]}" if text else type(e).__name__


# ---- CLI -----------------------------------------------------------------------------------------
def add_device_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--device --dtype --attention --vae-tiling/--no-vae-tiling --vae-slicing --offload`` from
    ``DeviceConfig``'s fields (``config_flags``).

    Values are checked by ``device_config_from_args`` (one ``InvalidParam`` line, exit 2), not by
    argparse ``choices`` (which prints usage over several lines).
    """
    ConfigFlags(parser.add_argument_group("device (DeviceConfig)"), DeviceConfig)


def device_config_from_args(args: Any) -> DeviceConfig:
    """The ``DeviceConfig`` of parsed ``add_device_flags`` arguments; raises ``InvalidParam``."""
    return DeviceConfig(
        device=args.device,
        dtype=args.dtype,
        attention=args.attention,
        vae_tiling=args.vae_tiling,
        vae_slicing=args.vae_slicing,
        offload=args.offload,
    )


# ---- torch threads -------------------------------------------------------------------------------
def split_threads(processes: int = 1, cores: int | None = None, load: float | None = None) -> int:
    """torch threads for each of ``processes`` processes that compute at once (``serve``'s local
    workers, a multi-rank ``generate``'s ranks, or one CLI process): the machine's cores less those
    other processes keep busy (the one-minute load average, rounded), split evenly; at least 1.

    ``cores``/``load`` default to ``os.cpu_count()``/``os.getloadavg()``. On a busy machine this is
    1: OpenMP threads that wait on each other for a core stall, many times slower than one thread,
    with the same bytes out.
    """
    cores = cores if cores is not None else os.cpu_count() or 1
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    idle = cores - min(cores, round(load))
    return max(1, idle // max(1, processes))


def add_threads_flag(parser: argparse.ArgumentParser) -> None:
    """``--threads N`` (0, the default: ``split_threads`` over the command's processes)."""
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (default 0: the idle cores, by the load average, split among this command's "
        "processes, as serve splits them among its workers)",
    )


def check_threads(threads: int) -> None:
    if threads < 0:
        raise InvalidParam("--threads", threads, "must be >= 0 (0: split the idle cores)")


def set_torch_threads(threads: int, processes: int = 1) -> int:
    """Give torch in this process ``threads`` threads (0: ``split_threads(processes)``); returns the count."""
    import torch

    check_threads(threads)
    n = threads or split_threads(processes)
    torch.set_num_threads(n)
    logger.info("torch threads: %d%s", n, "" if threads else f" (idle cores split among {processes} process(es))")
    return n
