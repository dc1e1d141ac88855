"""Image routes: ``POST /v1/images/generations`` (JSON) and ``POST /v1/images/edits`` (multipart, one
image). ``n`` images are ``n`` jobs with consecutive seeds, admitted together and run concurrently.
The request's ``model`` picks the served model (default: the first image model, the first
edit-capable one for edits). An edit's image is an uploaded file or ``url`` (a base64 data: URL);
without ``size`` (or with ``"auto"``) its output has the input's size (``input_size``). At a size the model was not trained at, or with words in the prompt that a
shipped shape-world model does not know, the response carries a note in ``warnings`` and in the
``X-Triptych-Warning`` header, and the server logs it.
``stream=true`` (one image, b64_json) answers with server-sent events (``http_image_stream``).
A seeded request may be answered from the head's result cache (``result_use``): each image whose
exact repeat is stored is not run; a streamed hit sends only the final image (no previews).
A request waits for its images until they come, its client disconnects (499) or
``request_timeout_s`` passes (504); a stream, until its first event.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import time

from fastapi import FastAPI, Request, Response

from triptych.control.backend import GenerationJob
from triptych.core import offload
from triptych.core.errors import InvalidParam
from triptych.core.media import decode_data_url
from triptych.head.api_models import ImageData, ImageEditForm, ImageGenerationRequest, ImagesResponse, inline_schema
from triptych.head.result_use import cache_keys, lookup, store
from triptych.head.routes_common import (
    build_params,
    deadline,
    deadline_at,
    job_deadline,
    read_form,
    read_upload,
    resolve,
    run_jobs,
    tenant_weight,
    text_fields,
)
from triptych.head.routes_image_stream import stream_cached, stream_image
from triptych.head.state import WARNING_HEADER, Head, ModelHead, header_value


def check_stream(req) -> None:
    """``stream``/``partial_images`` rules: previews only when streaming; a stream is one image as
    base64 (OpenAI's events have no image index and no url)."""
    if req.partial_images and not req.stream:
        raise InvalidParam("partial_images", req.partial_images, "applies to stream=true only")
    if req.stream and (req.n or 1) != 1:
        raise InvalidParam("n", req.n, "must be 1 with stream=true")
    if req.stream and req.response_format == "url":
        raise InvalidParam("response_format", req.response_format, "stream=true sends b64_json")


async def generate_images(head: ModelHead, request: Request, req, image, endpoint: str) -> ImagesResponse:
    t0 = time.perf_counter()
    head.limits.check_n(req.n or 1)
    check_stream(req)
    if head.family.is_video:
        raise InvalidParam("model", head.model_id, "is a video model; use POST /v1/videos")
    params, size = build_params(head, req, image=image)
    params = resolve(head, params, size)
    notes = head.warnings(params, edit=image is not None)
    fmt = req.output_format or "png"
    if req.output_compression is not None and fmt == "png":
        raise InvalidParam(
            "output_compression", req.output_compression, "applies to jpeg and webp only (png is lossless)"
        )
    rid = f"img-{secrets.token_hex(8)}"
    jobs = [
        GenerationJob(
            f"{rid}-{i}",
            params.replace(seed=params.seed + i),
            fmt,
            quality=req.output_compression,
            partial_images=req.partial_images or 0,
            deadline=deadline_at(head, t0),
            weight=tenant_weight(head),
            **job_deadline(head, req.deadline_s, t0),
        )
        for i in range(req.n or 1)
    ]
    keys = await cache_keys(head, req, jobs)
    outputs = lookup(head, keys, len(jobs))
    # 429 at once when the estimate is past the deadline (a cached image runs nothing)
    head.backend.check_deadlines([job for job, out in zip(jobs, outputs) if out is None])
    if req.stream:
        prefix = "image_edit" if image is not None else "image_generation"
        size = f"{params.width}x{params.height}"
        if outputs[0] is not None:
            return stream_cached(head, outputs[0], prefix, endpoint, size, fmt, t0, notes)
        key = keys[0] if keys else None
        return await stream_image(
            head, request, jobs[0], prefix, endpoint, size, t0, notes, on_result=lambda data: store(head, key, data)
        )
    todo = [i for i, out in enumerate(outputs) if out is None]
    if todo:
        with head.admission.admit(len(todo)):
            async with deadline(head, t0):
                ran = await run_jobs(head, request, [jobs[i] for i in todo])
        for i, data in zip(todo, ran):
            outputs[i] = data
            store(head, keys[i] if keys else None, data)
    expires = None
    if req.response_format == "url":
        data = []
        for out in outputs:
            file_id, expires = await asyncio.to_thread(head.files.put, out, fmt)
            data.append(ImageData(url=f"{head.base_url(request)}/v1/files/{file_id}/content"))
    else:
        data = [ImageData(b64_json=base64.b64encode(out).decode("ascii")) for out in outputs]
    head.metrics.record_request(endpoint, "success", time.perf_counter() - t0)
    size = f"{params.width}x{params.height}"
    seeds = [j.params.seed for j in jobs]
    return ImagesResponse(
        created=int(time.time()),
        data=data,
        output_format=fmt,
        size=size,
        seeds=seeds,
        expires_at=expires,
        warnings=notes or None,
    )


#: an edit's default size: the input's, each side floored to this (a multiple every family's takes)
EDIT_SIZE_STEP = 16


def input_size(head: ModelHead, image) -> str:
    """An edit's default output size: the input image's, scaled down (aspect kept) to fit the head's
    ``max_pixels`` and floored to ``EDIT_SIZE_STEP`` per side."""
    width, height = image.size
    scale = min(1.0, (head.limits.max_pixels / (width * height)) ** 0.5)
    width, height = (max(EDIT_SIZE_STEP, int(v * scale) // EDIT_SIZE_STEP * EDIT_SIZE_STEP) for v in (width, height))
    return f"{width}x{height}"


def _with_warning(out, response: Response):
    """A JSON answer's warnings, also as a header (a stream answers with its own response)."""
    if isinstance(out, ImagesResponse) and out.warnings:
        response.headers[WARNING_HEADER] = header_value(out.warnings)
    return out


def _edit_schema() -> dict:
    schema = inline_schema(ImageEditForm)
    schema["properties"]["image"] = {"type": "string", "format": "binary", "description": "the image to edit"}
    schema["required"] = [*schema.get("required", []), "image"]
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": schema}}}}


#: the 200 of an image route: JSON, or with stream=true server-sent events (``http_image_stream``)
STREAMED = {
    200: {
        "description": "the images; with stream=true, server-sent events (partial images, then completed)",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}


def add_image_routes(app: FastAPI, head: Head) -> None:
    @app.post("/v1/images/generations", response_model=ImagesResponse, responses=STREAMED)
    async def generations(req: ImageGenerationRequest, request: Request, response: Response):
        model = head.backend_for(req.model, "image")
        return _with_warning(await generate_images(model, request, req, None, "/v1/images/generations"), response)

    @app.post("/v1/images/edits", response_model=ImagesResponse, responses=STREAMED, openapi_extra=_edit_schema())
    async def edits(request: Request, response: Response):
        form = await read_form(head, request)
        fields = text_fields(form, skip=("image", "image[]", "mask"))
        model = head.backend_for(fields.get("model") if isinstance(fields.get("model"), str) else None, "edit")
        if not model.family.accepts_image:
            raise InvalidParam(
                "image",
                "<image>",
                f"model {model.model_id!r} ({model.family.name}) is text-only; edits need an image-conditioned model",
            )
        images = form.getlist("image") or form.getlist("image[]")
        if form.get("mask") is not None:
            raise InvalidParam("mask", "<mask>", "masks are not supported; the model edits the whole image")
        req = ImageEditForm.model_validate(fields)
        if req.url is not None:
            if images:
                raise InvalidParam("url", req.url[:40], "the image is given as a file too: give image or url")
            image = await offload.run(decode_data_url, req.url, head.limits.image_limits, "url")
        else:
            if len(images) != 1:
                why = "exactly one image file (or url, a base64 data: URL) is required"
                raise InvalidParam("image", f"<{len(images)} files>", why)
            image = await read_upload(head, images[0], "image")
        if req.size in (None, "auto"):
            req = req.model_copy(update={"size": input_size(model, image)})
        return _with_warning(await generate_images(model, request, req, image, "/v1/images/edits"), response)
