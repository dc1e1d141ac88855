"""What the head learns and tells about encoders' vision-tower embeddings (control-plane data only).

An encoder reports, with a request's ``EncodeDone`` / ``ChatDone``, the embeddings the request's
images have there (``MMImage``: mm-hash, dtype and shape). The head's image affinity remembers them;
when it sends a request with such an image to another encoder, the task carries an ``MMHint`` per
embedding: who holds it and where to fetch it from (``worker.mm_remote``).
"""

from __future__ import annotations

import msgspec

from triptych.transfer.refs import TensorSpec


class MMImage(msgspec.Struct, kw_only=True, frozen=True):
    """One embedding an encoder holds for a request's image."""

    mm_hash: str  # the encoder layer's key (content, processor output, model identity, tenant)
    spec: TensorSpec  # dtype and shape (tokens, hidden) of the stored embedding


class MMHint(msgspec.Struct, kw_only=True, frozen=True):
    """Another encoder holds this embedding: on a local miss, fetch it from there."""

    holder: str  # instance id of the encoder that reported it
    address: str  # the holder's transfer endpoint ("tcp://host:port"), where the fetch is asked
    tenant: str  # the tenant scope it was made for (also inside the mm-hash)
    mm_hash: str
    spec: TensorSpec  # dtype and shape; shape[0] is its token count

    @property
    def tokens(self) -> int:
        return self.spec.shape[0] if self.spec.shape else 0
