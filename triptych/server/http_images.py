"""Image routes (``/v1/images/generations``, ``/v1/images/edits``) and the request plumbing videos share:
API fields → ``GenerationParams`` (``build_params``), model validation with API field names
(``resolve``), bounded multipart parsing (``read_form``) and running jobs while watching for a client
disconnect (``run_jobs``).
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import time
from typing import Any

from fastapi import FastAPI, Request
from starlette.datastructures import UploadFile

from triptych.errors import InvalidParam
from triptych.pipelines.base import GenerationParams
from triptych.pipelines.teacache import check_teacache
from triptych.server import metrics
from triptych.server.api_models import ImageData, ImageEditForm, ImageGenerationRequest, ImagesResponse, inline_schema
from triptych.server.backend import GenerationJob
from triptych.server.media import decode_image

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


def build_params(head, req, image=None, frames: int | None = None) -> tuple[GenerationParams, str | None]:
    """Check the head's limits on an API request and build unresolved params; returns (params, size)."""
    lim = head.limits
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
        guidance=req.guidance_scale,
        seed=seed,
        image=image,
        true_cfg=1.0 if req.true_cfg_scale is None else req.true_cfg_scale,
        teacache_threshold=req.teacache_threshold or 0.0,
    )
    return params, req.size


def resolve(head, params: GenerationParams, size: str | None, frames_field: str = "frames") -> GenerationParams:
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
    check_teacache(head.family, p)  # refused at the door rather than as a failed stage
    return p


async def read_form(head, request: Request, max_files: int = 2):
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


async def read_upload(head, value: Any, field: str):
    """An uploaded file field → decoded RGB image (limits checked before the full decode)."""
    if not isinstance(value, UploadFile):
        raise InvalidParam(field, _short_text(value), "must be an uploaded image file (multipart)")
    data = await value.read(head.limits.max_upload_bytes + 1)
    return await asyncio.to_thread(decode_image, data, head.limits.image_limits, field)


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


async def wait_disconnect(request: Request) -> None:
    """Returns when the client has disconnected (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def run_jobs(head, request: Request, jobs: list[GenerationJob]) -> list[bytes]:
    """Run ``jobs`` concurrently; the first failure cancels the rest; a client disconnect cancels all."""
    tasks = [asyncio.create_task(head.backend.run(j)) for j in jobs]
    watcher = asyncio.create_task(wait_disconnect(request))
    error: BaseException | None = None
    try:
        pending: set[asyncio.Task] = {*tasks, watcher}
        while any(not t.done() for t in tasks):
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                from triptych.server.http import ClientGone

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


async def generate_images(head, request: Request, req, image, endpoint: str) -> ImagesResponse:
    t0 = time.perf_counter()
    head.limits.check_n(req.n or 1)
    if head.family.is_video:
        raise InvalidParam("model", head.model_id, "is a video model; use POST /v1/videos")
    params, size = build_params(head, req, image=image)
    params = resolve(head, params, size)
    fmt = req.output_format or "png"
    if req.output_compression is not None and fmt == "png":
        raise InvalidParam(
            "output_compression", req.output_compression, "applies to jpeg and webp only (png is lossless)"
        )
    rid = f"img-{secrets.token_hex(8)}"
    jobs = [
        GenerationJob(f"{rid}-{i}", params.replace(seed=params.seed + i), fmt, quality=req.output_compression)
        for i in range(req.n or 1)
    ]
    with head.admission.admit(len(jobs)):
        outputs = await run_jobs(head, request, jobs)
    expires = None
    if req.response_format == "url":
        data = []
        for out in outputs:
            file_id, expires = await asyncio.to_thread(head.files.put, out, fmt)
            data.append(ImageData(url=f"{head.base_url(request)}/v1/files/{file_id}/content"))
    else:
        data = [ImageData(b64_json=base64.b64encode(out).decode("ascii")) for out in outputs]
    metrics.record_request(endpoint, "success", time.perf_counter() - t0)
    size = f"{params.width}x{params.height}"
    seeds = [j.params.seed for j in jobs]
    return ImagesResponse(
        created=int(time.time()), data=data, output_format=fmt, size=size, seeds=seeds, expires_at=expires
    )


def _edit_schema() -> dict:
    schema = inline_schema(ImageEditForm)
    schema["properties"]["image"] = {"type": "string", "format": "binary", "description": "the image to edit"}
    schema["required"] = [*schema.get("required", []), "image"]
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": schema}}}}


def add_image_routes(app: FastAPI, head) -> None:
    @app.post("/v1/images/generations", response_model=ImagesResponse)
    async def generations(req: ImageGenerationRequest, request: Request):
        return await generate_images(head, request, req, None, "/v1/images/generations")

    @app.post("/v1/images/edits", response_model=ImagesResponse, openapi_extra=_edit_schema())
    async def edits(request: Request):
        if not head.family.accepts_image:
            raise InvalidParam(
                "image",
                "<image>",
                f"model {head.model_id!r} ({head.family.name}) is text-only; edits need an image-conditioned model",
            )
        form = await read_form(head, request)
        images = form.getlist("image") or form.getlist("image[]")
        if len(images) != 1:
            raise InvalidParam("image", f"<{len(images)} files>", "exactly one image file is required")
        if form.get("mask") is not None:
            raise InvalidParam("mask", "<mask>", "masks are not supported; the model edits the whole image")
        req = ImageEditForm.model_validate(text_fields(form, skip=("image", "image[]", "mask")))
        image = await read_upload(head, images[0], "image")
        return await generate_images(head, request, req, image, "/v1/images/edits")
