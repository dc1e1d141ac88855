"""Mooncake data path: the sender writes into the receiver's registered arena with Mooncake's
TransferEngine (TCP here, RDMA on clusters; P2P handshake, no metadata server), and ZMQ carries
the tiny claim / done notices that make the write visible to the receiver.

Push protocol: WriteClaim (ack) -> transfer_sync_write of the bytes -> WriteDone (ack -> READY).
"""

from __future__ import annotations

import logging
import threading

import torch

from triptych.server.transfer.arena import ByteArena
from triptych.server.transfer.base import TransferConfig
from triptych.server.transfer.errors import BackendUnavailable, SlotUnavailable, TransferError
from triptych.server.transfer.messages import Request, WriteClaim, WriteDone
from triptych.server.transfer.peer import Entry, PeerEndpoint
from triptych.server.transfer.refs import MooncakeLocation, TensorRef

logger = logging.getLogger(__name__)


def _start_engine(host: str) -> tuple[object, str]:
    """An initialized TransferEngine and its session id; BackendUnavailable if it cannot run."""
    try:
        from mooncake.engine import TransferEngine
    except (ImportError, OSError) as exc:  # OSError: libibverbs1 missing
        raise BackendUnavailable(f"mooncake.engine cannot be imported: {exc}") from exc
    engine = TransferEngine()
    rc = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise BackendUnavailable(f"mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, tcp) -> {rc}")
    return engine, f"{host}:{engine.get_rpc_port()}"


_ENGINES: dict[str, tuple[object, str]] = {}
_ENGINES_LOCK = threading.Lock()


def _shared_engine(host: str) -> tuple[object, str]:
    """The process's TransferEngine for `host`, created on first use and kept for the process
    lifetime: every endpoint of the process registers its buffers on it (an engine's teardown
    costs ~1 s, and one engine per process is what Mooncake expects)."""
    with _ENGINES_LOCK:
        if host not in _ENGINES:
            _ENGINES[host] = _start_engine(host)
        return _ENGINES[host]


class MooncakeEndpoint(PeerEndpoint):
    """Transfer endpoint moving bytes with Mooncake one-sided writes.

    Ownership contract: the endpoint shares its process's engine (see `_shared_engine`) and
    unregisters its own buffers on close. The receiver registers one arena of `max_bytes` once and gives each
    reservation a byte range of it; the sender registers one staging buffer of `staging_bytes`
    and copies tensors through it (in chunks), one push at a time. A range is reused only after its
    slot is released AND no write into it can be in flight: when a slot whose sender already
    claimed it is released (timeout, cancel), its range is parked until that sender's WriteDone
    arrives or the sender is reclaimed as dead. `wait_ready` returns a copy of the range.
    """

    kind = "mooncake"

    def __init__(self, instance_id: str, config: TransferConfig | None = None) -> None:
        config = config or TransferConfig()
        self._engine, self._session = _shared_engine(config.host)
        self._arena_buf = torch.empty(config.max_bytes, dtype=torch.uint8)
        self._staging = torch.empty(config.staging_bytes, dtype=torch.uint8)
        for buf in (self._arena_buf, self._staging):
            rc = self._engine.register_memory(buf.data_ptr(), buf.numel())
            if rc != 0:
                raise BackendUnavailable(f"mooncake register_memory({buf.numel()} bytes) -> {rc}")
        self._arena = ByteArena(config.max_bytes)
        self._parked: dict[str, tuple[int, str]] = {}  # transfer id -> (arena offset, peer)
        self._staging_lock = threading.Lock()
        super().__init__(instance_id, config)
        self._start()
        logger.info("mooncake engine session %s, arena %d bytes", self._session, config.max_bytes)

    # -- receiver hooks ---------------------------------------------------------------------------
    def _allocate(self, transfer_id: str, nbytes: int) -> tuple[int | None, MooncakeLocation | None]:
        offset = self._arena.alloc(nbytes)
        if offset is None:
            raise SlotUnavailable(
                f"{transfer_id!r}: no contiguous {nbytes} bytes in the arena "
                f"({self._arena.free_bytes} free, {len(self._parked)} ranges parked)"
            )
        return offset, MooncakeLocation(self._session, self._arena_buf.data_ptr() + offset)

    def _take(self, entry: Entry) -> torch.Tensor:
        if entry.tensor is not None:  # filled over the ZMQ data path
            return entry.tensor
        ref, offset = entry.ref, entry.offset
        assert offset is not None
        if ref.nbytes == 0:
            return torch.empty(ref.shape, dtype=ref.torch_dtype)
        raw = self._arena_buf[offset : offset + ref.nbytes].clone()
        return raw.view(ref.torch_dtype).reshape(ref.shape)

    def _free(self, entry: Entry) -> None:
        if entry.offset is None:
            return
        if entry.claimed:
            # NOTE: the sender may still be writing into this range; reusing it now could let
            # the late write corrupt another transfer's tensor.
            self._parked[entry.ref.transfer_id] = (entry.offset, entry.peer)
            return
        self._arena.free(entry.offset)

    def _on_claim(self, entry: Entry) -> str | None:
        entry.claimed = True
        return None

    def _on_write_done(self, entry: Entry, msg: WriteDone) -> str | None:
        if not entry.claimed:
            return f"{msg.transfer_id!r}: write done without a claim"
        entry.claimed = False
        if msg.failed:
            self._finish(msg.transfer_id, TransferError(f"{msg.transfer_id!r}: sender's write failed"))
            return None
        self._mark_ready(entry)
        return None

    def _on_unreserved(self, msg: Request) -> str:
        parked = self._parked.get(msg.transfer_id)
        if isinstance(msg, WriteDone) and parked is not None and parked[1] == msg.sender:
            del self._parked[msg.transfer_id]
            self._arena.free(parked[0])
            return f"{msg.transfer_id!r}: reservation was released before the write completed"
        return super()._on_unreserved(msg)

    def _buffers_idle(self) -> bool:
        return self._arena.allocated == 0 and not self._parked

    def _reclaim_parked(self, peer: str) -> None:
        for transfer_id, (offset, owner) in list(self._parked.items()):
            if owner == peer:
                del self._parked[transfer_id]
                self._arena.free(offset)

    # -- sender -----------------------------------------------------------------------------------
    def _push(self, ref: TensorRef, data: torch.Tensor, timeout_s: float) -> None:
        if ref.mooncake is None:  # receiver has no Mooncake engine: use its ZMQ data path
            self._push_data(ref, data, timeout_s)
            return
        claim = WriteClaim(next(self._seq), ref.transfer_id, self.instance_id, ref.nbytes)
        self._request(ref, claim, [], timeout_s)
        failed = True
        try:
            self._write(ref.mooncake, data)
            failed = False
        finally:
            done = WriteDone(next(self._seq), ref.transfer_id, self.instance_id, ref.nbytes, failed)
            self._request(ref, done, [], timeout_s)

    def _write(self, location: MooncakeLocation, data: torch.Tensor) -> None:
        src = data.reshape(-1).view(torch.uint8) if data.numel() else data.new_empty(0, dtype=torch.uint8)
        chunk = self._staging.numel()
        with self._staging_lock:
            for start in range(0, src.numel(), chunk):
                n = min(chunk, src.numel() - start)
                self._staging[:n].copy_(src[start : start + n])
                rc = self._engine.transfer_sync_write(
                    location.session, self._staging.data_ptr(), location.remote_addr + start, n
                )
                if rc != 0:
                    raise TransferError(f"mooncake write of {n} bytes to {location.session} -> {rc}")

    def _close_backend(self) -> None:
        for buf in (self._arena_buf, self._staging):
            rc = self._engine.unregister_memory(buf.data_ptr())
            if rc != 0:
                logger.warning("mooncake unregister_memory(%#x) -> %d", buf.data_ptr(), rc)
