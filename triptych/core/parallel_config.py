"""How one multi-rank denoiser instance splits its work: CFG parallel × ring × Ulysses.

CFG parallel puts the rows of a fused forward (cond rows, then uncond rows) on separate rank
groups and joins the predictions with one all-gather. Sequence parallel splits every row's token
sequence across ranks: Ulysses (DeepSpeed-Ulysses, https://arxiv.org/abs/2309.14509) swaps the
sequence split for a head split around attention with all-to-all; ring attention
(https://arxiv.org/abs/2310.01889) keeps the split and passes key/value chunks around, merging
partial results through their log-sum-exp. Both are diffusers' context parallel
(``diffusers.ContextParallelConfig``); this config only chooses the degrees.

It lives in ``core`` (no torch; ``triptych.parallel`` re-exports it) so a command line builds its
flags before torch is imported (``triptych generate --cfg-parallel``), as it does ``DeviceConfig``'s.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of one multi-rank instance; ``world_size`` = ``cfg`` × ``ring`` × ``ulysses`` ranks."""

    cfg: int = 1
    """CFG-parallel degree, 1 or 2. With 2, the rows of each fused forward are split in two contiguous
    halves (for a batch where every request has CFG: the cond rows and the uncond rows) computed by
    two rank groups; a forward with a single row is computed whole by both groups."""

    ulysses: int = 1
    """Ulysses degree (>= 1): ranks that exchange sequence shards for head shards around attention.
    Must divide the transformer's attention head count."""

    ring: int = 1
    """Ring-attention degree (>= 1): ranks that keep their sequence shard and rotate key/value chunks.
    On CPU it runs through ``triptych.parallel.attention``'s log-sum-exp attention."""

    uneven_sequences: bool = True
    """Accept token counts not divisible by the sequence-parallel degree (diffusers'
    ``ulysses_anything`` / ``ring_anything``: shards differ by at most one token, at the cost of a
    small size all-gather per attention call). Prompt lengths vary, so this is the serving default;
    diffusers supports it only when one of ``ulysses`` and ``ring`` is 1."""

    def __post_init__(self) -> None:
        if self.cfg not in (1, 2):
            raise ValueError(f"cfg={self.cfg!r}: CFG parallel has two branches; use 1 (off) or 2")
        for name in ("ulysses", "ring"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an integer >= 1 (1 turns it off)")
        if self.uneven_sequences and self.ulysses > 1 and self.ring > 1:
            raise ValueError(
                f"uneven_sequences=True with ulysses={self.ulysses} and ring={self.ring}: diffusers' unified "
                "ulysses×ring attention needs even shards; set uneven_sequences=False (token counts must then "
                f"divide by {self.sequence_degree}) or set one degree to 1"
            )

    @property
    def sequence_degree(self) -> int:
        """Ranks that share one row's sequence (ring × Ulysses)."""
        return self.ring * self.ulysses

    @property
    def world_size(self) -> int:
        """Ranks in the instance."""
        return self.cfg * self.sequence_degree

    def check_world_size(self, world_size: int) -> None:
        """Raise ``ValueError`` if the instance's process group does not have ``world_size`` ranks."""
        if world_size != self.world_size:
            raise ValueError(
                f"world size {world_size} != cfg×ring×ulysses = {self.cfg}×{self.ring}×{self.ulysses} = "
                f"{self.world_size}: start {self.world_size} ranks or change the degrees"
            )


#: ``ParallelConfig``'s flags not spelt ``--field-name`` (``serve``, ``worker``, ``generate``).
FLAG_NAMES = {"cfg": "cfg-parallel"}
