"""How the head's app runs under uvicorn: ``run_head`` (``triptych serve``) and ``uvicorn_config`` with
``HeaderTimeoutProtocol``, uvicorn's h11 protocol plus a header timeout.

uvicorn closes an idle keep-alive connection after ``timeout_keep_alive``, but nothing closes one
that opened and never finished its request head: a client that sends a partial request line (or
nothing) holds its socket forever, and fifty such clients hold fifty. Here a connection gets
``HeadConfig.header_timeout_s`` from when it opened, or from its first byte after a response, to
complete its request line and headers; past it the socket is closed (no response: there is no
request to answer). Once the headers are in, the timer is off: reading the body and waiting for
the answer have their own limits.

NOTE: h11 on purpose (not httptools, when installed): the timer reads h11's connection state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from triptych.head.state import HeadConfig

logger = logging.getLogger(__name__)


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol that closes a connection whose request head is not complete within
    ``header_timeout_s`` (a class attribute: ``protocol_with_header_timeout`` makes the subclass)."""

    header_timeout_s: float = 20.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE:  # a new request begins
            self._arm_header_timer()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # its head is complete (or the connection failed)
            self._disarm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            logger.info(
                "closed a connection from %s: no complete request head within %gs (header_timeout_s)",
                f"{self.client[0]}:{self.client[1]}" if self.client else "?",
                self.header_timeout_s,
            )
            self.transport.close()


def protocol_with_header_timeout(header_timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """A ``HeaderTimeoutProtocol`` subclass with this timeout (uvicorn builds one per connection)."""
    return type("HeadProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": header_timeout_s})


def uvicorn_config(app, config: HeadConfig, **kwargs) -> uvicorn.Config:
    """The uvicorn config ``serve`` runs the head's ``app`` with; ``kwargs`` go to ``uvicorn.Config``
    (host, port, log level, ...)."""
    return uvicorn.Config(app, http=protocol_with_header_timeout(config.header_timeout_s), **kwargs)


def run_head(app, config: HeadConfig, host: str, port: int) -> int:
    """Serve ``app`` on ``host:port`` until stopped (``triptych serve``); 3 when it failed to start
    (``uvicorn.run``'s exit status)."""
    server = uvicorn.Server(uvicorn_config(app, config, host=host, port=port, log_level="info"))
    with _signals_end_the_server():
        server.run()
    return 0 if server.started else 3


@contextlib.contextmanager
def _signals_end_the_server():
    """uvicorn shuts down on SIGINT/SIGTERM and then raises the signal again under the handler it found;
    under the default one the process died there, before ``serve`` stopped what it started (its vLLM
    servers, Ray): they were left to their parent-death signal, and a vLLM server still answered after
    ``serve`` had exited. Under this handler the signal is noted and ``run_head`` returns, so those
    ``finally`` blocks run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {
        s: signal.signal(s, lambda signum, _frame: caught.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if caught:
        logger.info("stopped by %s", signal.Signals(caught[-1]).name)
