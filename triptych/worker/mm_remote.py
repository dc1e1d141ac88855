"""Cross-encoder embedding hits: an image encoded on encoder A is a hit on encoder B, moved peer to peer.

The head's image affinity (``control.affinity``) knows which encoder holds which embeddings (each
encoder reports them with a request's ``EncodeDone`` / ``ChatDone``). When it sends a request to B
while A holds one of its images' embeddings, the task carries an ``MMHint`` (A, A's transfer
address, tenant, mm-hash, dtype and shape). B's encoder runner hands the hints to
``RemoteEmbeddings.hint``; on a local miss of that mm-hash (``MMEmbeddingCache.encode``), B reserves
a slot on its own endpoint for A, asks A's endpoint for the embedding (``FetchRequest``; only this
small message and its ack go peer to peer besides the bytes, nothing through the head), and waits
for A's push. A lends the stored tensor (``lend``): its entry is held under the loan, so nothing
evicts it mid-transfer, and released when the push completed, failed or timed out
(``transfer.lending``).

Any failure (A gone or slow past ``MMCacheConfig.remote_timeout_s``, the entry evicted there, another
token count than the request needs, a transfer error) makes ``fetch`` return None: B runs its own
tower, as without a hint, and the failure is counted (``RemoteStats``). A user never sees it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import msgspec
import torch

from triptych.control.mm_hints import MMHint
from triptych.mmcache.stats import RemoteStats
from triptych.transfer.errors import TransferError
from triptych.transfer.lending import Lending
from triptych.transfer.messages import FetchRequest
from triptych.transfer.refs import TensorRef, dtype_from_name, dtype_name

logger = logging.getLogger(__name__)


class RemoteEmbeddings:
    """One encoder's both ends: the hints its running requests carry and the fetches they make, and
    the loans of its own entries to peers. ``cache`` is its ``MMEmbeddingCache``; ``endpoint`` its
    transfer endpoint (a ``PeerEndpoint``).

    Hints are held per request (``hint`` / ``forget`` by the runner's holder id) and dropped once
    used, fetched or failed. Thread-safety: ``fetch``/``hint``/``forget`` run on the worker's loop
    thread; ``lend``/``give_back`` on the endpoint's threads; the counters are under a lock."""

    def __init__(self, cache, endpoint, timeout_s: float):
        self.cache = cache
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.stats = RemoteStats()
        self._lock = threading.Lock()
        self._hints: dict[str, tuple[MMHint, set[str]]] = {}  # mm-hash -> (hint, the requests carrying it)
        self._ids = itertools.count()

    # ---- the asking side ----------------------------------------------------------------------
    def hint(self, holder: str, tenant: str, hints) -> None:
        """The request ``holder`` (of ``tenant``) came with these hints."""
        for h in hints:
            if h.holder == self.endpoint.instance_id or h.tenant != tenant:
                continue  # our own (evicted since) or another tenant's: never used
            _, holders = self._hints.setdefault(h.mm_hash, (h, set()))
            holders.add(holder)

    def forget(self, holder: str) -> None:
        """The request ended: its hints go (unless another running request carries them too)."""
        for key in [k for k, (_, hs) in self._hints.items() if holder in hs]:
            holders = self._hints[key][1]
            holders.discard(holder)
            if not holders:
                del self._hints[key]

    def hinted(self) -> int:
        """Hints held now (0 once every request ended)."""
        return len(self._hints)

    def fetch(self, key: str, tokens: int) -> torch.Tensor | None:
        """The embedding under ``key`` from the encoder a hint names, or None (no hint, or it failed)."""
        entry = self._hints.pop(key, None)
        if entry is None:
            return None
        hint = entry[0]
        if hint.tokens != tokens:
            logger.info("hint for %s has %d tokens, the request needs %d: encoding here", key[:12], hint.tokens, tokens)
            return self._count(tokens=1)
        start = time.monotonic()
        tid = f"mm/{self.endpoint.instance_id}/{next(self._ids)}/{key[:16]}"
        try:
            ref = self.endpoint.reserve(
                tid, dtype_from_name(hint.spec.dtype), hint.spec.shape, hint.holder, self.timeout_s
            )
        except (TransferError, ValueError) as e:
            logger.warning("no slot to fetch %s from %s: %s", key[:12], hint.holder, e)
            return self._count(unreachable=1)
        try:
            return self._ask(hint, key, ref, start)
        finally:
            self.endpoint.release(tid)  # a no-op once wait_ready took the tensor

    def _ask(self, hint: MMHint, key: str, ref: TensorRef, start: float) -> torch.Tensor | None:
        sender = self.endpoint.sender
        msg = FetchRequest(sender.next_seq(), ref.transfer_id, self.endpoint.instance_id, ref.nbytes, key, ref)
        try:
            ack = sender.ask(hint.address, msg, self.timeout_s)
        except TransferError as e:
            logger.warning("%s did not answer the fetch of %s: %s; encoding here", hint.holder, key[:12], e)
            return self._count(unreachable=1)
        if not ack.ok:
            logger.info("%s refused the fetch of %s: %s; encoding here", hint.holder, key[:12], ack.reason)
            return self._count(refused=1)
        try:
            tensor = self.endpoint.wait_ready(ref.transfer_id, max(1e-3, self.timeout_s - (time.monotonic() - start)))
        except TransferError as e:
            logger.warning("the push of %s from %s did not arrive: %s; encoding here", key[:12], hint.holder, e)
            return self._count(unreachable=1)
        self._count(hits=1, bytes=ref.nbytes)
        return tensor

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + n)

    def snapshot(self) -> RemoteStats:
        with self._lock:
            return msgspec.structs.replace(self.stats)

    # ---- the lending side (``transfer.lending.Lender``) ----------------------------------------
    def lend(self, key: str, ref: TensorRef, loan: str) -> torch.Tensor | str:
        store = self.cache.store
        tensor = store.lend(key, ref.shape[0] if ref.shape else -1, loan)
        if tensor is None:
            return f"{key[:12]}: not held here with {ref.shape[0] if ref.shape else 0} tokens"
        if (dtype_name(tensor.dtype), tuple(tensor.shape)) != (ref.dtype, tuple(ref.shape)):
            store.release(loan)
            return f"{key[:12]}: held as {dtype_name(tensor.dtype)}{list(tensor.shape)}, asked {ref.dtype}{list(ref.shape)}"
        return tensor

    def give_back(self, loan: str, pushed: bool) -> None:
        self.cache.store.release(loan)
        self._count(**({"lent": 1} if pushed else {"lend_failed": 1}))


def attach(cache, endpoint, timeout_s: float) -> RemoteEmbeddings:
    """Give ``cache`` (an ``MMEmbeddingCache``) cross-encoder hits over ``endpoint``, both ways."""
    remote = RemoteEmbeddings(cache, endpoint, timeout_s)
    cache.connect_remote(remote)
    endpoint.lend_from(Lending(remote, endpoint.push))
    return remote
