"""The config flags ``triptych serve`` and ``triptych worker`` share (``WorkerFlags``), built from the
worker-side config dataclasses (``triptych.core.config_flags``): denoiser engine batch limits, transfer
pool, multi-rank degrees, the encoder's mm-hash cache and chat engine, and the device flags. The
config modules import torch, so ``cli/serve.py`` adds these flags only when a command uses them.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from triptych.core.config_flags import ConfigFlags

if TYPE_CHECKING:
    from triptych.engine.config import EngineConfig
    from triptych.transfer.base import TransferConfig

#: ``TransferConfig`` fields a worker takes from the command line (``WorkerConfig`` sets the rest).
WORKER_TRANSFER_FIELDS = ("max_bytes",)


def add_degree_flags(group) -> ConfigFlags:
    """``--cfg-parallel --ulysses --ring`` from ``ParallelConfig`` (no torch: ``generate``, ``quality``)."""
    from triptych.core.parallel_config import FLAG_NAMES, ParallelConfig

    return ConfigFlags(group, ParallelConfig, only=("cfg", "ulysses", "ring"), rename=FLAG_NAMES)


@dataclass(frozen=True)
class WorkerFlags:
    """The config flags ``serve`` and ``worker`` share: engine batch limits, transfer pool, compile and
    quantization."""

    parser: argparse.ArgumentParser
    engine: ConfigFlags
    transfer: ConfigFlags
    parallel: ConfigFlags
    mm_cache: ConfigFlags
    chat: ConfigFlags
    speed: ConfigFlags
    lora: ConfigFlags

    @classmethod
    def add(cls, parser: argparse.ArgumentParser) -> WorkerFlags:
        from triptych.chat.config import ChatEngineConfig
        from triptych.cli.accel_flags import add_speed_flags
        from triptych.core.devices import add_device_flags
        from triptych.core.parallel_config import FLAG_NAMES as PARALLEL_FLAG_NAMES
        from triptych.core.parallel_config import ParallelConfig
        from triptych.engine.config import EngineConfig
        from triptych.mmcache.cache import FLAG_NAMES, MMCacheConfig
        from triptych.transfer.base import TransferConfig

        engine = ConfigFlags(parser.add_argument_group("denoiser engine (EngineConfig)"), EngineConfig)
        group = parser.add_argument_group("tensor transfer (TransferConfig)")
        transfer = ConfigFlags(group, TransferConfig, prefix="transfer-", only=WORKER_TRANSFER_FIELDS)
        group = parser.add_argument_group("multi-rank denoiser (ParallelConfig)")
        parallel = ConfigFlags(group, ParallelConfig, rename=PARALLEL_FLAG_NAMES)
        group = parser.add_argument_group("encoder layer: mm-hash caches and vision batching (MMCacheConfig)")
        mm_cache = ConfigFlags(group, MMCacheConfig, rename=FLAG_NAMES)
        if os.environ.get("TRIPTYCH_MM_CACHE_MB"):  # the environment as the flag's default, nothing more
            parser.set_defaults(mm_cache_mb=float(os.environ["TRIPTYCH_MM_CACHE_MB"]))
        chat = ConfigFlags(parser.add_argument_group("encoder chat engine (ChatEngineConfig)"), ChatEngineConfig)
        from triptych.lora.config import LoraConfig

        lora = ConfigFlags(parser.add_argument_group("LoRA adapters (LoraConfig)"), LoraConfig)
        add_device_flags(parser)
        speed = add_speed_flags(parser)
        return cls(parser, engine, transfer, parallel, mm_cache, chat, speed, lora)

    def lora_config(self, args: argparse.Namespace):
        return self.lora.build(args, self.parser)

    def parallel_config(self, args: argparse.Namespace):
        return self.parallel.build(args, self.parser)

    def mm_cache_config(self, args: argparse.Namespace):
        return self.mm_cache.build(args, self.parser)

    def chat_config(self, args: argparse.Namespace):
        return self.chat.build(args, self.parser)

    def speed_config(self, args: argparse.Namespace):
        """``SpeedConfig`` checked against the device (``InvalidParam``)."""
        from triptych.cli.accel_flags import speed_config

        return speed_config(self.speed, args, self.parser, args.device, os.environ.get("TRIPTYCH_CACHE"))

    def engine_config(self, args: argparse.Namespace) -> EngineConfig:
        return self.engine.build(args, self.parser)

    def transfer_config(self, args: argparse.Namespace) -> TransferConfig:
        return self.transfer.build(args, self.parser)

    def argv(self, args: argparse.Namespace) -> tuple[str, ...]:
        """The flags that give a ``triptych worker`` the same engine and transfer settings."""
        return (
            *self.engine.argv(self.engine_config(args)),
            *self.transfer.argv(self.transfer_config(args)),
            *self.mm_cache.argv(self.mm_cache_config(args)),
            *self.chat.argv(self.chat_config(args)),
            *self.speed.argv(self.speed_config(args)),
            *self.lora.argv(self.lora_config(args)),
        )
