"""Choose and build the transfer endpoint of one instance."""

from __future__ import annotations

import logging
from typing import Literal

from triptych.server.transfer.base import TransferConfig, TransferEndpoint
from triptych.server.transfer.errors import BackendUnavailable
from triptych.server.transfer.peer import PeerEndpoint

logger = logging.getLogger(__name__)

BackendKind = Literal["auto", "mooncake", "zmq"]


def make_endpoint(kind: BackendKind, instance_id: str, config: TransferConfig | None = None) -> TransferEndpoint:
    """Build the endpoint: "mooncake" (raises BackendUnavailable if it cannot run), "zmq", or
    "auto" = Mooncake when `mooncake.engine` imports and initializes, else ZMQ."""
    if kind == "zmq":
        return PeerEndpoint(instance_id, config)
    if kind not in ("auto", "mooncake"):
        raise ValueError(f"transfer backend {kind!r} is not one of 'auto', 'mooncake', 'zmq'")
    from triptych.server.transfer.mooncake_backend import mooncake_endpoint

    try:
        endpoint: TransferEndpoint = mooncake_endpoint(instance_id, config)
    except BackendUnavailable as exc:
        if kind == "mooncake":
            raise
        logger.info("transfer backend auto -> zmq for %s (mooncake unavailable: %s)", instance_id, exc)
        return PeerEndpoint(instance_id, config)
    if kind == "auto":
        logger.info("transfer backend auto -> mooncake for %s", instance_id)
    return endpoint


def mooncake_available() -> bool:
    """True when `mooncake.engine` can be imported (it may still fail to initialize)."""
    try:
        import mooncake.engine  # noqa: F401
    except (ImportError, OSError):
        return False
    return True
