"""Mooncake data path: the sender writes into the receiver's registered arena with Mooncake's
TransferEngine (TCP here, RDMA on clusters; P2P handshake, no metadata server), and ZMQ carries
the tiny claim / done notices that make the write visible to the receiver.

Push protocol (run by the endpoint, `peer.py` / `sender.py`): WriteClaim (ack) -> the carrier's
transfer_sync_write of the bytes -> WriteDone (ack -> READY). This module is the carrier.
"""

from __future__ import annotations

import logging
import threading

import torch

from triptych.core.kinds import TransferKind
from triptych.transfer.arena import ByteArena
from triptych.transfer.base import TransferConfig
from triptych.transfer.errors import BackendUnavailable, TransferError
from triptych.transfer.peer import PeerEndpoint
from triptych.transfer.refs import MooncakeLocation, TensorRef

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
    is slow, and one engine per process is what Mooncake expects)."""
    with _ENGINES_LOCK:
        if host not in _ENGINES:
            _ENGINES[host] = _start_engine(host)
        return _ENGINES[host]


class MooncakeCarrier:
    """One endpoint's Mooncake memory: a registered receive arena and a registered send staging buffer.

    Ownership contract: the carrier shares its process's engine (see `_shared_engine`) and
    registers two buffers of its own, unregistered by `close`. The arena (`max_bytes`) is carved
    into one range per reservation (`allocate` / `free`, called under the endpoint's lock); `read`
    returns a copy, so a range can be reused as soon as it is freed. `write` copies a tensor
    through the staging buffer (`staging_bytes`, in chunks), one write at a time.
    """

    kind = TransferKind.MOONCAKE

    def __init__(self, config: TransferConfig) -> None:
        self._engine, self._session = _shared_engine(config.host)
        self._arena_buf = torch.empty(config.max_bytes, dtype=torch.uint8)
        self._staging = torch.empty(config.staging_bytes, dtype=torch.uint8)
        registered = []
        for buf in (self._arena_buf, self._staging):
            rc = self._engine.register_memory(buf.data_ptr(), buf.numel())
            if rc != 0:
                self._unregister(registered)
                raise BackendUnavailable(f"mooncake register_memory({buf.numel()} bytes) -> {rc}")
            registered.append(buf)
        self._arena = ByteArena(config.max_bytes)
        self._staging_lock = threading.Lock()
        logger.info("mooncake engine session %s, arena %d bytes", self._session, config.max_bytes)

    @property
    def allocated(self) -> int:
        return self._arena.allocated

    @property
    def free_bytes(self) -> int:
        return self._arena.free_bytes

    def allocate(self, nbytes: int) -> tuple[int, MooncakeLocation] | None:
        offset = self._arena.alloc(nbytes)
        if offset is None:
            return None
        return offset, MooncakeLocation(self._session, self._arena_buf.data_ptr() + offset)

    def read(self, offset: int, ref: TensorRef) -> torch.Tensor:
        if ref.nbytes == 0:
            return torch.empty(ref.shape, dtype=ref.torch_dtype)
        raw = self._arena_buf[offset : offset + ref.nbytes].clone()
        return raw.view(ref.torch_dtype).reshape(ref.shape)

    def free(self, offset: int) -> None:
        self._arena.free(offset)

    def write(self, location: MooncakeLocation, data: torch.Tensor) -> None:
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

    def close(self) -> None:
        self._unregister((self._arena_buf, self._staging))

    def _unregister(self, buffers) -> None:
        for buf in buffers:
            rc = self._engine.unregister_memory(buf.data_ptr())
            if rc != 0:
                logger.warning("mooncake unregister_memory(%#x) -> %d", buf.data_ptr(), rc)


def mooncake_endpoint(instance_id: str, config: TransferConfig | None = None) -> PeerEndpoint:
    """An endpoint moving bytes with Mooncake one-sided writes (frames still accepted and used
    towards receivers without Mooncake); raises BackendUnavailable if Mooncake cannot run."""
    config = config or TransferConfig()
    carrier = MooncakeCarrier(config)
    try:
        return PeerEndpoint(instance_id, config, carrier)
    except BaseException:
        carrier.close()
        raise
