"""Request plumbing the route modules share: API fields → ``GenerationParams`` (``build_params``),
model validation with API field names (``resolve``), bounded multipart parsing (``read_form``,
``read_upload``, ``text_fields``), large JSON bodies parsed off the event loop (``OffloadRoute``,
``parse_json``: ``core/offload.py``) and running jobs while watching for a client disconnect
(``run_jobs``, ``wait_disconnect``) under the request's deadline (``deadline``). Every function
takes the app's ``Head`` and keeps no state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.datastructures import UploadFile

from triptych.accel.teacache_profile import profiles_dir_in
from triptych.control.backend import GenerationJob
from triptych.core import offload
from triptych.core.errors import InvalidParam
from triptych.core.media import decode_image
from triptych.families.params import GenerationParams
from triptych.families.teacache_check import check_teacache
from triptych.head.state import TENANT, ClientGone, DeadlineExceeded, Head, ModelHead

#: GenerationParams field → the API field a user set.
API_FIELD = {
    "height": "size",
    "width": "size",
    "steps": "num_inference_steps",
    "guidance": "guidance_scale",
    "true_cfg": "true_cfg_scale",
    "teacache_threshold": "teacache_threshold",
}
FORM_TEXT_LIMIT = 4 * 1024 * 1024  # largest non-file multipart field (prompts are capped lower later)
#: JSON bodies from this size on are parsed in the offload pool (a large chat body would hold the loop);
#: smaller ones on the loop, where the hop to a thread would cost more than the parse.
OFFLOAD_JSON_BYTES = 256 * 1024


async def parse_json(body: bytes) -> Any:
    """``json.loads(body)``, off the event loop when the body is large."""
    return json.loads(body) if len(body) < OFFLOAD_JSON_BYTES else await offload.run(json.loads, body)


class _OffloadedRequest(Request):
    async def json(self) -> Any:  # what FastAPI awaits for a route's JSON body
        if not hasattr(self, "_json"):
            self._json = await parse_json(await self.body())
        return self._json


class OffloadRoute(APIRoute):
    """The app's route class: FastAPI parses a route's JSON body with ``request.json()``, which
    here runs ``parse_json`` (a large body is parsed off the event loop)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def offloaded(request: Request):
            return await handler(_OffloadedRequest(request.scope, request.receive))

        return offloaded


def same_knob(ours: str, our_value, theirs: str, their_value):
    """One setting given by Triptych's name and/or a peer's (``num_frames`` for ``frames``): the value
    given; a 400 naming both when both are given and differ."""
    if their_value is None:
        return our_value
    if our_value is not None and our_value != their_value:
        raise InvalidParam(theirs, their_value, f"differs from {ours}={our_value!r}: the same setting; give one")
    return their_value


def build_params(head: Head, req, image=None, frames: int | None = None) -> tuple[GenerationParams, str | None]:
    """Check the head's limits on an API request and build unresolved params; returns (params, size).
    For a family whose ``guidance`` is diffusers' ``true_cfg_scale`` (Qwen-Image), that field is
    taken as ``guidance_scale``."""
    lim = head.limits
    guidance, true_cfg = req.guidance_scale, req.true_cfg_scale
    if true_cfg is not None and getattr(head.family, "true_cfg_is_guidance", False):
        guidance, true_cfg = same_knob("guidance_scale", guidance, "true_cfg_scale", true_cfg), None
    head.check_model(req.model)
    lim.check_prompt(req.prompt)
    lim.check_prompt(req.negative_prompt, "negative_prompt")
    lim.check_steps(req.num_inference_steps)
    width, height = lim.parse_size(req.size)
    seed = req.seed if req.seed is not None else secrets.randbelow(2**31)
    params = GenerationParams(
        prompt=req.prompt,
        negative_prompt=req.negative_prompt,
        height=height,
        width=width,
        frames=frames,
        steps=req.num_inference_steps,
        guidance=guidance,
        seed=seed,
        image=image,
        true_cfg=1.0 if true_cfg is None else true_cfg,
        teacache_threshold=req.teacache_threshold or 0.0,
        tenant=TENANT.get(),
        lora=head.served.lora.check(_lora_value(getattr(req, "lora", None))),
        priority=head.tenants.priority(req.priority, TENANT.get()),
    )
    params = params.replace(lora_paths=head.served.lora.paths(params.lora))
    return params, req.size


def job_deadline(head: ModelHead, value: float | None, t0: float) -> dict[str, float | None]:
    """A job's ``deadline_s`` (the request's, else the model's ``HeadConfig.slo``) and its moment on
    ``time.monotonic``, counted from ``t0`` (``time.perf_counter`` when the route began), as
    ``GenerationJob`` keyword arguments."""
    seconds = value if value is not None else head.slo_s
    if seconds is None:
        return {"deadline_s": None, "deadline_at": None}
    return {"deadline_s": seconds, "deadline_at": time.monotonic() - (time.perf_counter() - t0) + seconds}


def tenant_weight(head: ModelHead) -> float:
    """The fair-queue weight of the request's tenant (``HeadConfig.tenant_policies``)."""
    return head.tenants.policy(TENANT.get()).weight


def _lora_value(value):
    """The API's ``lora`` as plain values (names, or ``{"name", "scale"}`` dicts) for the catalog."""
    if value is None or isinstance(value, str):
        return value
    return [item.model_dump() for item in value]


def resolve(head: Head, params: GenerationParams, size: str | None, frames_field: str = "frames") -> GenerationParams:
    """``family.resolve`` with its errors renamed to API fields, then the head's post-default checks."""
    try:
        p = head.family.resolve(params)
    except InvalidParam as e:
        if e.field in ("height", "width"):
            shown = size if size not in (None, "auto") else f"{params.width}x{params.height}"
            raise InvalidParam("size", shown, f"{e.field} {e.rule}") from None
        if e.field == "frames":
            raise InvalidParam(frames_field, e.value, e.rule) from None
        raise InvalidParam(API_FIELD.get(e.field, e.field), e.value, e.rule) from None
    head.limits.check_resolved(p.width, p.height, p.frames, p.steps)
    frames = f", {p.frames} frames" if head.family.is_video else ""
    head.limits.check_tokens(head.family.sequence_tokens(p), f"{p.width}x{p.height}{frames}")
    root = head.config.teacache_profiles_root  # the workers look in the same place (WorkerConfig)
    check_teacache(head.family, p, root and profiles_dir_in(root, head.family.model_dir))  # at the door
    return p


async def read_form(head: Head, request: Request, max_files: int = 2):
    """Multipart/urlencoded body with the upload limit enforced while reading (no Content-Length trust)."""
    budget = head.limits.max_upload_bytes + FORM_TEXT_LIMIT
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > budget:
        raise InvalidParam("image", f"<{declared} bytes>", f"request body must be at most {budget} bytes")
    seen = 0
    receive = request.receive

    async def counting_receive():
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > budget:
            raise InvalidParam("image", f"<more than {budget} bytes>", f"request body must be at most {budget} bytes")
        return message

    limited = Request(request.scope, counting_receive)
    return await limited.form(max_files=max_files, max_fields=64, max_part_size=FORM_TEXT_LIMIT)


async def read_upload(head: Head, value: Any, field: str):
    """An uploaded file field → decoded RGB image (limits checked before the full decode)."""
    if not isinstance(value, UploadFile):
        raise InvalidParam(field, _short_text(value), "must be an uploaded image file (multipart)")
    data = await value.read(head.limits.max_upload_bytes + 1)
    return await offload.run(decode_image, data, head.limits.image_limits, field)


def _short_text(value) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def text_fields(form, skip: tuple[str, ...]) -> dict[str, Any]:
    """Form fields other than ``skip`` (files) as a dict; a repeated field keeps its values as a list."""
    out: dict[str, Any] = {}
    for key in form.keys():
        if key in skip:
            continue
        values = form.getlist(key)
        for v in values:
            if isinstance(v, UploadFile):
                raise InvalidParam(key, v.filename, "must be a text field, not a file")
        out[key] = values[0] if len(values) == 1 else values
    return out


@contextlib.asynccontextmanager
async def deadline(head: Head | ModelHead, t0: float):
    """The request's deadline: ``head.config.request_timeout_s`` from ``t0`` (``time.perf_counter``
    when the route began). Past it, what runs inside is cancelled (it cancels its jobs in the backend
    on the way out) and ``DeadlineExceeded`` (HTTP 504) is raised."""
    limit = head.config.request_timeout_s
    scope = asyncio.timeout(limit - (time.perf_counter() - t0))
    try:
        async with scope:
            yield
    except TimeoutError:
        if scope.expired():
            raise DeadlineExceeded(limit) from None
        raise


def deadline_at(head: Head | ModelHead, t0: float) -> float:
    """The request's deadline (``deadline``) as a ``time.monotonic()`` value, for its jobs
    (``GenerationJob.deadline``): a retry waiting for a replacement worker gives up then."""
    return time.monotonic() + head.config.request_timeout_s - (time.perf_counter() - t0)


async def wait_disconnect(request: Request) -> None:
    """Returns when the client has disconnected (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def run_jobs(head: Head, request: Request, jobs: list[GenerationJob]) -> list[bytes]:
    """Run ``jobs`` concurrently; the first failure cancels the rest; a client disconnect cancels all."""
    tasks = [asyncio.create_task(head.backend.run(j)) for j in jobs]
    watcher = asyncio.create_task(wait_disconnect(request))
    error: BaseException | None = None
    try:
        pending: set[asyncio.Task] = {*tasks, watcher}
        while any(not t.done() for t in tasks):
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                error = ClientGone()
                break
            failed = [t for t in done if t.exception() is not None]
            if failed:
                error = failed[0].exception()
                break
    except asyncio.CancelledError:
        error = asyncio.CancelledError()
    finally:
        watcher.cancel()
        if error is not None:
            await asyncio.gather(*(head.backend.cancel(j.request_id) for j, t in zip(jobs, tasks) if not t.done()))
            await asyncio.gather(*tasks, return_exceptions=True)
    if error is not None:
        raise error
    return [t.result() for t in tasks]
