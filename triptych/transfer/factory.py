"""Choose and build the transfer endpoint of one instance."""

from __future__ import annotations

import ipaddress
import logging

from triptych.core.kinds import TransferKind
from triptych.transfer.base import TransferConfig, TransferEndpoint
from triptych.transfer.errors import BackendUnavailable
from triptych.transfer.peer import PeerEndpoint

logger = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def make_endpoint(kind: TransferKind | str, instance_id: str, config: TransferConfig | None = None) -> TransferEndpoint:
    """Build the endpoint: "mooncake" (raises BackendUnavailable if it cannot run), "zmq", or
    "auto" = Mooncake when `mooncake.engine` imports and initializes and the host is not a loopback
    address, else ZMQ.

    NOTE: Mooncake 0.3.13's TransferEngine listens on every interface whatever host it is given (its
    RPC and TCP-transport ports; MC_TCP_BIND_ADDRESS and the other settings tried do not change
    that), while the ZMQ endpoint binds only ``config.host``. A deployment bound to loopback
    therefore gets ZMQ under "auto"; an explicit "mooncake" says which ports it exposes."""
    config = config or TransferConfig()
    if kind not in set(TransferKind):
        raise ValueError(f"transfer backend {kind!r} is not one of {', '.join(TransferKind)}")
    if kind == TransferKind.ZMQ or (kind == TransferKind.AUTO and is_loopback(config.host)):
        return PeerEndpoint(instance_id, config)
    from triptych.transfer.mooncake_backend import mooncake_endpoint

    try:
        endpoint: TransferEndpoint = mooncake_endpoint(instance_id, config)
    except BackendUnavailable as exc:
        if kind == TransferKind.MOONCAKE:
            raise
        logger.info("transfer backend auto -> zmq for %s (mooncake unavailable: %s)", instance_id, exc)
        return PeerEndpoint(instance_id, config)
    if kind == TransferKind.AUTO:
        logger.info("transfer backend auto -> mooncake for %s", instance_id)
    logger.warning(
        "%s: Mooncake's transfer engine listens on all interfaces (not only %s); firewall its ports",
        instance_id,
        config.host,
    )
    return endpoint


def mooncake_available() -> bool:
    """True when `mooncake.engine` can be imported (it may still fail to initialize)."""
    try:
        import mooncake.engine  # noqa: F401
    except (ImportError, OSError):
        return False
    return True
