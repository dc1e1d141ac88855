"""``MMCacheConfig``, the encoder layer's settings, and its command-line flag names: no torch, so a
command builds its flags from it before torch is imported (``triptych generate``'s ``--mm-cache-mb``)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class MMCacheConfig:
    """The encoder layer's caches and its per-step vision budget, one per loaded encoder."""

    max_mb: float = 256.0
    """Budget in MiB (2**20 bytes) of stored vision-tower outputs (the embedding tier); entries no
    running request holds are evicted least recently used first when a new one needs the room. 0
    turns the encoder layer off (no tier, no batching)."""

    processor_mb: float = 256.0
    """Budget in MiB of stored image-processor outputs (pixel patches and grids by image bytes and
    processor settings), LRU. 0 turns that tier off."""

    step_images: int = 8
    """Most images the encoder's vision tower takes in one batched forward per scheduling step;
    further images wait for the next step, taken round-robin across requests."""

    step_vision_tokens: int = 16384
    """Most vision tokens (after the merger) in one batched forward per step; an image larger than
    this alone still runs, alone."""

    shared_dir: str = ""
    """A directory the encoders of one host share (``mmcache.shared``): embeddings one computed are
    written there and read by another's miss before it runs its tower. Empty: not shared."""

    shared_mb: float = 1024.0
    """Budget in MiB of the shared directory; past it the least recently written files are removed."""

    remote: bool = True
    """Fetch a missing embedding from the encoder the head says holds it (``worker.mm_remote``, peer to
    peer over the transfer plane) instead of running the tower, and lend this encoder's to peers."""

    remote_timeout_s: float = 2.0
    """How long a fetch from another encoder may take (its answer, then the push) before this encoder
    gives up and runs its own tower (counted as ``unreachable``)."""

    def __post_init__(self) -> None:
        for name in ("max_mb", "processor_mb", "shared_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"MMCacheConfig.{name}={value!r}: must be a number of MiB (0 turns it off)")
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"MMCacheConfig.{name}={value}: must be a finite number >= 0 (0 turns it off)")
        if not (isinstance(self.remote_timeout_s, (int, float)) and 0 < self.remote_timeout_s <= 600):
            raise ValueError(f"MMCacheConfig.remote_timeout_s={self.remote_timeout_s!r}: must be in (0, 600] seconds")
        for name in ("step_images", "step_vision_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MMCacheConfig.{name}={value!r}: must be an integer >= 1")

    @property
    def max_bytes(self) -> int:
        return int(self.max_mb * (1 << 20))

    @property
    def processor_bytes(self) -> int:
        return int(self.processor_mb * (1 << 20))


#: ``MMCacheConfig``'s command-line flags (``triptych serve`` / ``triptych worker``).
FLAG_NAMES = {
    "max_mb": "mm-cache-mb",
    "processor_mb": "mm-processor-cache-mb",
    "step_images": "encoder-step-images",
    "step_vision_tokens": "encoder-step-vision-tokens",
    "shared_dir": "mm-shared-dir",
    "shared_mb": "mm-shared-mb",
    "remote": "mm-remote",
    "remote_timeout_s": "mm-remote-timeout-s",
}
