"""Request bodies, bounded before they are parsed: size, media type and read time (ASGI middleware).

- A JSON (or any non-multipart) body larger than ``max_json_bytes`` gets 413: at once when its
  ``Content-Length`` says so, or as soon as the bytes received pass the limit (chunked bodies), so
  the head never holds more than the limit of it. Multipart uploads keep their own budget
  (``http_common.read_form``: the upload limit plus the form's text fields).
- A POST to the API must be ``application/json`` or ``multipart/form-data`` (415 otherwise): a
  ``text/plain`` body is what any web page may send cross-site without a preflight. The form routes
  (``FORM_ROUTES``) also take ``application/x-www-form-urlencoded``, which a page may send as freely
  as a multipart form, so it opens nothing new there; it is bounded as multipart is.
- A client that stops sending in the middle of its body (a slow or half-open connection) gets 408
  after ``read_timeout_s`` without a byte, and its connection is closed. The timeout covers the body
  only: once its last part arrived, a ``receive()`` (a route watching for the client to disconnect
  while its request runs) waits as long as the request lives (``HeadConfig.request_timeout_s``).
"""

from __future__ import annotations

import asyncio
import json

from starlette.exceptions import HTTPException

ALLOWED_TYPES = (b"application/json", b"multipart/form-data")
URLENCODED = b"application/x-www-form-urlencoded"
#: routes that take urlencoded bodies too (what vLLM-Omni's video clients send)
FORM_ROUTES = ("/v1/videos",)


class BodyLimit:
    def __init__(self, app, max_json_bytes: int, read_timeout_s: float, api_prefix: str = "/v1/"):
        self.app = app
        self.max_json_bytes = max_json_bytes
        self.read_timeout_s = read_timeout_s
        self.api_prefix = api_prefix

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        media = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        form_route = scope["path"].rstrip("/") in FORM_ROUTES
        allowed = (*ALLOWED_TYPES, URLENCODED) if form_route else ALLOWED_TYPES
        if scope["path"].startswith(self.api_prefix) and media not in allowed:
            shown = media.decode("latin-1") or "none"
            also = (
                ", multipart/form-data or application/x-www-form-urlencoded"
                if form_route
                else " or multipart/form-data"
            )
            return await _refuse(send, 415, f"invalid Content-Type={shown!r}: send application/json{also}")
        limit = None if media in (b"multipart/form-data", URLENCODED) else self.max_json_bytes
        declared = headers.get(b"content-length")
        if limit is not None and declared is not None:
            if not declared.isdigit():
                return await _refuse(send, 400, "invalid Content-Length header")
            if int(declared) > limit:
                return await _refuse(send, 413, _too_large(int(declared), limit))
        return await self.app(scope, self._bounded(receive, limit), send)

    def _bounded(self, receive, limit: int | None):
        seen = 0
        complete = False  # the body's last part arrived: what follows is a disconnect, unbounded

        async def bounded_receive():
            nonlocal seen, complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout_s)
            except TimeoutError:
                raise HTTPException(408, f"request body not received within {self.read_timeout_s:g}s") from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if limit is not None and seen > limit:
                    raise HTTPException(413, _too_large(seen, limit, at_least=True))
                complete = not message.get("more_body", False)
            return message

        return bounded_receive


def _too_large(size: int, limit: int, at_least: bool = False) -> str:
    what = f"at least {size}" if at_least else str(size)
    return f"invalid body size={what} bytes: a JSON body may have at most {limit} bytes (max_json_bytes)"


async def _refuse(send, status: int, message: str) -> None:
    """An OpenAI-shaped error, sent before the body was read (the connection is then closed)."""
    kind = "invalid_request_error"
    code = {413: "too_large", 415: "unsupported_media_type", 408: "timeout"}.get(status, "invalid_value")
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": [*headers, (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
