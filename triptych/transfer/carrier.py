"""What a transfer endpoint needs from a one-sided-write backend (Mooncake): receiver memory that
remote senders write into, and the write itself.

Every endpoint moves bytes in ZMQ frames (`peer.PeerEndpoint`): that path needs no carrier. An
endpoint built with a carrier also gives each reservation a range of the carrier's memory, puts
where it lives in the `TensorRef`, and writes into a receiver's range when the ref it pushes to
names one. The claim / done protocol around a write, and when a range may be reused, stay with the
endpoint; a carrier only owns memory and moves bytes.
"""

from __future__ import annotations

from typing import Protocol

import torch

from triptych.core.kinds import TransferKind
from triptych.transfer.refs import MooncakeLocation, TensorRef


class Carrier(Protocol):
    """Registered receiver memory and one-sided writes into a peer's.

    Ownership contract: the carrier owns its buffers from construction until `close`; a range from
    `allocate` belongs to the endpoint until it calls `free(offset)` exactly once. `allocate`,
    `read`, `free` and `allocated` are called under the endpoint's lock; `write` is called by
    sending threads and serializes itself.
    """

    kind: TransferKind  # the backend reported in stats and metrics

    @property
    def allocated(self) -> int:
        """Number of ranges handed out and not yet freed."""
        ...

    @property
    def free_bytes(self) -> int:
        """Bytes not handed out (not necessarily contiguous)."""
        ...

    def allocate(self, nbytes: int) -> tuple[int, MooncakeLocation] | None:
        """A range of `nbytes`: (offset, where a remote writer reaches it), or None when no
        contiguous room is left."""
        ...

    def read(self, offset: int, ref: TensorRef) -> torch.Tensor:
        """The range's bytes as `ref`'s tensor, in storage of its own (a copy)."""
        ...

    def free(self, offset: int) -> None:
        """Return a range; no write may be in flight into it."""
        ...

    def write(self, location: MooncakeLocation, data: torch.Tensor) -> None:
        """Write the bytes of contiguous CPU `data` into a peer's range; raises TransferError."""
        ...

    def close(self) -> None:
        """Release the memory (after the endpoint stopped serving)."""
        ...
