"""The HTTP head: OpenAI-compatible routes over one ``GenerationBackend`` per served model.

``create_app(backends, HeadConfig(...))`` builds the FastAPI app; ``backends`` is one backend or
model id → backend (in serving order: the first of a kind is that kind's default). The request's
``model`` field picks the backend (``Head.backend_for``). The head validates every request against
``AdmissionLimits`` and the model's family (a weightless adapter is enough), turns it into
``GenerationJob``s and awaits ``backend.run``; it never sees a tensor. Errors leave in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``: bad input is a 400 naming the field, the value
and the limit; ``Overloaded`` is a 429 with Retry-After; ``StageFailed`` is a 502; ``Unavailable`` (a
role with no live instance) a 503 with Retry-After; a request past ``request_timeout_s`` a 504.

This module only wires: it builds the ``Head`` (``head/state.py``), installs the error handlers and
the API-key check, and adds the routes: images (``http_images``), videos (``http_videos``), chat
(``http_chat``), the browser playground at ``/`` (``http_playground``), and here models, health,
metrics, files. Route modules share their plumbing through
``http_common``; none of them imports another, or this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from triptych.control.backend import (
    Cancelled,
    DeadlineMissed,
    DeadlineRefused,
    GenerationBackend,
    Overloaded,
    StageFailed,
    Unavailable,
)
from triptych.control.metrics import CONTENT_TYPE
from triptych.core import offload
from triptych.core.errors import InvalidParam, shown, shown_name
from triptych.head.admission import retry_after_header
from triptych.head.api_models import PEER_HINTS, ErrorResponse, ModelCard, ModelList
from triptych.head.body_limit import BodyLimit
from triptych.head.routes_chat import add_chat_routes
from triptych.head.routes_common import OffloadRoute
from triptych.head.routes_images import add_image_routes
from triptych.head.routes_lora import add_lora_routes
from triptych.head.routes_playground import add_playground_routes
from triptych.head.routes_videos import add_video_routes
from triptych.head.state import TENANT, ClientGone, DeadlineExceeded, Head, HeadConfig, tenant_of_key

__all__ = ["HeadConfig", "create_app"]

logger = logging.getLogger(__name__)


# ---- errors in OpenAI's shape ---------------------------------------------------------------------
def error_response(
    status: int,
    message: str,
    type_: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict | None = None,
) -> JSONResponse:
    body = ErrorResponse.model_validate({"error": {"message": message, "type": type_, "param": param, "code": code}})
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _union_member(part) -> bool:
    """pydantic's name for the member of a union type an error is about ("constrained-float",
    "literal['auto']"): part of its location, not of the field's name."""
    return isinstance(part, str) and ("[" in part or re.fullmatch(r"[a-z]+(-[a-z]+)+", part) is not None)


def validation_message(errors) -> tuple[str, str | None]:
    """pydantic errors → (one message naming field, value and rule; the first field)."""
    parts, first = [], None
    for err in list(errors)[:5]:
        loc = [
            str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path", "form") and not _union_member(p)
        ]
        name = shown_name(".".join(loc)) or None
        if err.get("type") != "json_invalid":
            first = first or name
        if err.get("type") == "missing" and name is None:  # no body at all (or an empty one)
            parts.append("missing request body: must be a JSON object with this endpoint's fields")
        elif err.get("type") == "missing":
            parts.append(f"missing required field {name}")
        elif err.get("type") == "json_invalid":
            parts.append(f"request body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})")
        elif name is None:  # the body itself: a list, a number, a string where an object belongs
            parts.append(f"invalid request body={shown(err.get('input'))}: must be a JSON object")
        elif err.get("type") == "extra_forbidden":
            hint = PEER_HINTS.get(loc[-1]) if loc else None
            hint = f" (Triptych's field for it is {hint})" if hint else ""
            parts.append(f"unknown field {name}={shown(err.get('input'))}: not a parameter of this endpoint{hint}")
        else:
            parts.append(f"invalid {name}={shown(err.get('input'))}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request", first


def _endpoint(request: Request) -> str:
    route = request.scope.get("route")
    return getattr(route, "path", "unmatched")


def install_error_handlers(app: FastAPI) -> None:
    def outcome(request: Request, kind: str) -> None:
        request.app.state.head.metrics.record_request(_endpoint(request), kind)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        outcome(request, "invalid")
        message, param = validation_message(exc.errors())
        return error_response(400, message, "invalid_request_error", param, "invalid_value")

    @app.exception_handler(ValidationError)
    async def on_model_validation(request: Request, exc: ValidationError):
        outcome(request, "invalid")
        message, param = validation_message(exc.errors())
        return error_response(400, message, "invalid_request_error", param, "invalid_value")

    @app.exception_handler(InvalidParam)
    async def on_invalid(request: Request, exc: InvalidParam):
        outcome(request, "invalid")
        field = shown_name(exc.field)
        message = f"invalid {field}={shown(exc.value)}: {exc.rule}"
        return error_response(400, message, "invalid_request_error", field, "invalid_value")

    @app.exception_handler(Overloaded)
    async def on_overloaded(request: Request, exc: Overloaded):
        outcome(request, "overloaded")
        headers = {"Retry-After": retry_after_header(exc.retry_after)}
        code, param = ("deadline", "deadline_s") if isinstance(exc, DeadlineRefused) else ("queue_full", None)
        return error_response(429, str(exc), "rate_limit_error", param, code, headers)

    @app.exception_handler(DeadlineMissed)
    async def on_deadline_missed(request: Request, exc: DeadlineMissed):
        outcome(request, "timed_out")
        return error_response(504, str(exc), "server_error", "deadline_s", "deadline_missed")

    @app.exception_handler(Cancelled)
    async def on_cancelled(request: Request, exc: Cancelled):
        outcome(request, "cancelled")
        return error_response(409, f"request {exc} was cancelled", "invalid_request_error", None, "cancelled")

    @app.exception_handler(ClientGone)
    async def on_gone(request: Request, exc: ClientGone):
        outcome(request, "cancelled")
        return error_response(499, "client disconnected; the request was cancelled", "invalid_request_error")

    @app.exception_handler(DeadlineExceeded)
    async def on_deadline(request: Request, exc: DeadlineExceeded):
        outcome(request, "timed_out")
        message = (
            f"request not answered within its deadline of {exc.limit_s:g}s (request_timeout_s, "
            "--request-timeout-s); it was cancelled"
        )
        return error_response(504, message, "server_error", None, "timeout")

    @app.exception_handler(Unavailable)
    async def on_unavailable(request: Request, exc: Unavailable):
        outcome(request, "unavailable")
        headers = {"Retry-After": retry_after_header(exc.retry_after)}
        return error_response(503, str(exc), "server_error", None, "unavailable", headers)

    @app.exception_handler(StageFailed)
    async def on_stage_failed(request: Request, exc: StageFailed):
        outcome(request, "failed")
        return error_response(502, f"generation failed on a worker: {exc}", "server_error", None, "stage_failed")

    @app.exception_handler(HTTPException)
    async def on_http(request: Request, exc: HTTPException):
        outcome(request, "invalid" if exc.status_code < 500 else "error")
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 413: "too_large"}.get(
            exc.status_code
        )
        return error_response(exc.status_code, str(exc.detail), type_, None, code, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        outcome(request, "error")
        return error_response(500, f"internal server error ({type(exc).__name__})", "server_error")


# ---- the app --------------------------------------------------------------------------------------
ERROR_RESPONSES = {code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 429, 502, 503, 504)}


def pool_counts(describe: dict) -> dict[str, dict[str, int]]:
    """Each role that has local workers: its live instances (registered, not draining) against the
    local workers configured for it (scaled-in ones excluded). Remote-only pools have no configured
    size and are not listed."""
    workers = describe.get("local_workers", {}).get("workers", {}).values()
    configured = Counter(w["role"] for w in workers if "role" in w and not w.get("retired"))
    live = Counter(i.get("role") for i in describe.get("instances", ()) if i.get("state") != "draining")
    return {role: {"live": live[role], "configured": n} for role, n in sorted(configured.items())}


OPEN_PATHS = ("/health", "/metrics", "/v1/files/")  # never behind the API key


def api_key_check(keys: tuple[str, ...]):
    """A FastAPI dependency: with ``keys``, every route outside ``OPEN_PATHS`` needs one of them as
    a bearer token (compared in constant time); a 401 in OpenAI's error shape otherwise."""
    encoded = [k.encode() for k in keys]

    async def check(request: Request) -> None:
        if not encoded or request.url.path.startswith(OPEN_PATHS):
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        if scheme.lower() != "bearer" or not given:
            raise HTTPException(
                401, "missing API key: send 'Authorization: Bearer <key>'", {"WWW-Authenticate": "Bearer"}
            )
        if not any(hmac.compare_digest(given, k) for k in encoded):
            raise HTTPException(401, "invalid API key", {"WWW-Authenticate": "Bearer"})
        TENANT.set(tenant_of_key(given))

    return check


def create_app(backends: GenerationBackend | Mapping[str, GenerationBackend], config: HeadConfig) -> FastAPI:
    """The head's FastAPI app; startup opens the stores and starts every backend, shutdown closes them.

    One bare backend is served as ``config.served_model_name`` or its model directory's name."""
    if isinstance(backends, GenerationBackend):
        backends = {config.served_model_name or Path(backends.family.model_dir).name: backends}
    head = Head(backends, config)
    offload.configure(config.media_threads)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await head.open()
        sweeper = asyncio.create_task(head.sweep_forever(), name="head-sweeper")
        watcher = asyncio.create_task(head.watch_loop_forever(), name="head-loop-lag")
        try:
            yield
        finally:
            sweeper.cancel()
            watcher.cancel()
            await head.close()

    app = FastAPI(
        title="Triptych",
        version="0.1.0",
        lifespan=lifespan,
        responses=ERROR_RESPONSES,
        dependencies=[Depends(api_key_check(config.api_keys))],
    )
    app.state.head = head
    app.router.route_class = OffloadRoute  # large JSON bodies are parsed off the event loop
    app.add_middleware(BodyLimit, max_json_bytes=config.max_json_bytes, read_timeout_s=config.body_read_timeout_s)
    install_error_handlers(app)
    add_image_routes(app, head)
    add_video_routes(app, head)
    add_chat_routes(app, head)
    add_lora_routes(app, head)
    add_playground_routes(app)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models():
        return ModelList(data=[m.card() for m in head.models])

    @app.get("/v1/models/{model_id}", response_model=ModelCard)
    async def get_model(model_id: str):
        return head.models.pick(model_id, "image").card()

    @app.get("/health")
    async def health():
        """``ok``; ``degraded`` (200) while a local worker is down or given up, or a role has fewer
        live instances than local workers configured for it (``roles``: live against configured,
        e.g. one of two denoisers during a replacement), but every role of every model still has a
        live instance; ``unavailable`` (503) while a role of some model has none. ``models`` has each
        model's pools; ``model``, ``backend``, ``roles`` and ``missing_roles`` the first model's
        (what a one-model head always showed)."""
        models, statuses = {}, []
        for m in head.models:
            desc = m.backend.describe()
            empty = desc.get("empty_roles", [])
            down = [iid for iid, w in desc.get("local_workers", {}).get("workers", {}).items() if not w["running"]]
            roles = pool_counts(desc)
            short = any(r["live"] < r["configured"] for r in roles.values())
            statuses.append("unavailable" if empty else "degraded" if down or short else "ok")
            models[m.name] = {"status": statuses[-1], "kind": m.kind, "in_flight": m.admission.in_flight}
            models[m.name].update({"missing_roles": empty} if empty else {}, roles=roles, backend=desc)
        status = next((s for s in ("unavailable", "degraded") if s in statuses), "ok")
        first = models[head.models.first.name]
        body = {"status": status, "model": head.models.first.name, "in_flight": head.in_flight()}
        body.update(roles=first["roles"], backend=first["backend"], models=models)
        missing = sorted({r for m in models.values() for r in m.get("missing_roles", [])})
        if missing:
            body["missing_roles"] = missing
        return JSONResponse(body, status_code=503 if status == "unavailable" else 200)

    @app.get("/metrics", response_class=Response)
    async def prometheus():
        return Response(head.render_metrics(), media_type=CONTENT_TYPE)

    @app.get("/v1/files/{file_id}/content", response_class=FileResponse)
    async def file_content(file_id: str):
        found = head.files.get(file_id)
        if found is None:
            raise HTTPException(404, f"file {shown(file_id)} does not exist or its link expired")
        return FileResponse(found[0], media_type=found[1])

    return app
