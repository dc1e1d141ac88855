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

    priority_age_ticks: int = 100
    """Ageing of priority classes: a request waiting this many ticks more than another counts one
    class more urgent against it, so no request waits forever behind more urgent ones (the bound is
    in ``engine.scheduler``)."""

    lower_class_places: int | None = None
    """Places of a batch that requests of a less urgent class than the batch's most urgent one may
    take: none = every place the urgent class leaves (batching is nearly free on a GPU); 0 = an urgent
    request runs with its own class only, the others preempted while it runs (where a step's time
    grows with its batch, as on a CPU)."""

    max_parked_bytes: int = 1 << 30
    """Memory for the state of preempted requests (latents, conditioning, scheduler and TeaCache
    state): on a CUDA device it is moved to pinned host memory while the request waits, elsewhere it
    stays and is counted. A request whose state does not fit waits where it is; 0 = park nothing."""

    def __post_init__(self) -> None:
        if self.max_batch_requests < 1:
            raise ValueError(f"max_batch_requests={self.max_batch_requests}: must be >= 1")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens={self.max_batch_tokens}: must be >= 1")
        if self.priority_age_ticks < 1:
            raise ValueError(f"priority_age_ticks={self.priority_age_ticks}: must be >= 1")
        if self.lower_class_places is not None and self.lower_class_places < 0:
            raise ValueError(f"lower_class_places={self.lower_class_places}: must be >= 0 (or none)")
        if self.max_parked_bytes < 0:
            raise ValueError(f"max_parked_bytes={self.max_parked_bytes}: must be >= 0 (0 = park nothing)")
