"""``--compile``, ``--compile-cache-dir``, ``--quantize`` from ``SpeedConfig`` (generate, serve, worker,
quality), and the config they build with its cache directory resolved and its startup checks run."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from triptych.accel.config import SpeedConfig
from triptych.core.config_flags import ConfigFlags


def add_speed_flags(parser: argparse.ArgumentParser) -> ConfigFlags:
    return ConfigFlags(parser.add_argument_group("compile and quantization (SpeedConfig)"), SpeedConfig)


def speed_config(
    flags: ConfigFlags,
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    device: str = "cpu",
    cache_root=None,
) -> SpeedConfig:
    """The parsed ``SpeedConfig`` (cache directory: ``cache_root``'s ``inductor/`` unless given); raises
    ``InvalidParam`` for a setting this machine cannot run (``apply.check_speed``)."""
    from triptych.accel.apply import check_speed

    config = flags.build(args, parser)
    if config.compile and config.compile_cache_dir is None:
        config = dataclasses.replace(config, compile_cache_dir=default_cache_dir(cache_root))
    check_speed(config, device)
    return config


def default_cache_dir(cache_root: str | Path | None = None) -> Path:
    """``<user cache dir>/inductor`` ($TRIPTYCH_CACHE, passed in by the CLI, or ~/.cache/triptych)."""
    from triptych.families.models import cache_dir

    return cache_dir(cache_root) / "inductor"
