"""Configuration of the denoiser engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    max_batch_requests: int = 8
    """Most requests in one forward (each contributes one row per CFG branch)."""

    max_batch_tokens: int = 65536
    """Most transformer tokens in one forward: sum over rows of the row's latent sequence length.
    A request larger than this alone still runs, alone."""

    fuse_cfg: bool = True
    """Run the cond and uncond branches of every request in one forward (stacked rows). False runs
    one forward per branch, the order the diffusers pipelines use (bit-identical to them)."""

    def __post_init__(self) -> None:
        if self.max_batch_requests < 1:
            raise ValueError(f"max_batch_requests={self.max_batch_requests}: must be >= 1")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens={self.max_batch_tokens}: must be >= 1")
