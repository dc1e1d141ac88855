"""Video routes: ``POST /v1/videos`` starts an asynchronous job (``jobs.VideoJobs``); ``GET`` polls it,
``GET .../content`` downloads the MP4, ``DELETE`` cancels and deletes, ``GET /v1/videos`` lists.

The create body is multipart (what the OpenAI SDK sends, with an optional ``input_reference`` file),
urlencoded (what vLLM-Omni's clients send) or JSON (``input_reference`` as
``{"image_url": "data:image/png;base64,..."}``). ``GET /v1/videos?limit=0`` is an empty page whose
``has_more`` says whether any video follows the cursor.
A seeded create whose exact repeat is in the head's result cache (``result_use``) is answered with a
job that is already ``completed``, its MP4 the stored one; nothing runs.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from typing import Literal

from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import FileResponse
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

from triptych.control.backend import GenerationJob
from triptych.core import offload
from triptych.core.errors import InvalidParam, shown
from triptych.core.media import decode_data_url
from triptych.head.api_models import (
    VideoCreateRequest,
    VideoDeleted,
    VideoError,
    VideoList,
    VideoObject,
    inline_schema,
)
from triptych.head.jobs import VideoRecord
from triptych.head.result_use import cache_keys, lookup, store
from triptych.head.routes_common import (
    build_params,
    job_deadline,
    parse_json,
    read_form,
    read_upload,
    resolve,
    same_knob,
    tenant_weight,
    text_fields,
)
from triptych.head.state import WARNING_HEADER, Head, ModelHead, header_value

FRAME_SEARCH = 8  # seconds → frames: try this many counts above seconds*fps for one the model accepts


def to_api(rec: VideoRecord) -> VideoObject:
    error = VideoError(code=rec.error_code, message=rec.error_message or "") if rec.error_code else None
    return VideoObject(
        id=rec.id,
        created_at=rec.created_at,
        status=rec.status,
        progress=rec.progress,
        model=rec.model,
        prompt=rec.prompt,
        seconds=rec.seconds,
        size=rec.size,
        frames=rec.frames,
        completed_at=rec.completed_at,
        expires_at=rec.expires_at,
        error=error,
    )


#: the condition image's field names: Triptych's (OpenAI's) and a peer's for the same image
REFERENCE_FIELDS = ("input_reference", "image_reference")


async def parse_create(head: Head, request: Request):
    """The create body (JSON, multipart or urlencoded) → (validated request, condition image or None).
    ``image_reference`` is ``input_reference`` by another name; both at once is a 400 naming both."""
    ctype = request.headers.get("content-type", "")
    uploads: dict[str, UploadFile] = {}
    if ctype.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        form = await read_form(head, request)
        uploads = {name: form.get(name) for name in REFERENCE_FIELDS if isinstance(form.get(name), UploadFile)}
        fields = text_fields(form, skip=tuple(uploads))
        for name in REFERENCE_FIELDS:
            prefix = f"{name}["
            nested = {k[len(prefix) : -1]: fields.pop(k) for k in list(fields) if k.startswith(prefix)}
            if nested:
                fields[name] = nested
        req = VideoCreateRequest.model_validate(fields)
    else:
        try:
            body = await parse_json(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            raise InvalidParam("body", "<request body>", f"must be a JSON object or multipart form ({e})") from None
        if not isinstance(body, dict):
            raise InvalidParam("body", type(body).__name__, "must be a JSON object")
        req = VideoCreateRequest.model_validate(body)
    given = [name for name in REFERENCE_FIELDS if name in uploads or getattr(req, name) is not None]
    if len(given) > 1:
        raise InvalidParam("image_reference", "<image>", "is input_reference by another name: give one of them")
    if not given:
        return req, None
    name = given[0]
    if name in uploads:
        return req, await read_upload(head, uploads[name], name)
    return req, await offload.run(_decode_reference, head, getattr(req, name), name)


def _decode_reference(head: Head, ref, field: str = "input_reference"):
    if ref.file_id is not None or ref.image_url is None:
        raise InvalidParam(field, ref.file_id, "only an uploaded file or a base64 data: URL image_url")
    return decode_data_url(ref.image_url, head.limits.image_limits, f"{field}.image_url")


def fps_of(head: ModelHead, req: VideoCreateRequest) -> int:
    """The video's frame rate: the request's ``fps``, else the server's ``--video-fps``."""
    return req.fps or head.config.video_fps


def fold_peer_names(head: ModelHead, req: VideoCreateRequest) -> VideoCreateRequest:
    """vLLM-Omni's ``num_frames`` and ``width``/``height`` as ``frames`` and ``size`` (a 400 naming
    both names when both are given and differ)."""
    frames = same_knob("frames", req.frames, "num_frames", req.num_frames)
    size = req.size
    if req.width is not None or req.height is not None:
        if req.width is None or req.height is None:
            given, missing = ("width", "height") if req.height is None else ("height", "width")
            raise InvalidParam(missing, None, f"is needed with {given} (or give size as WIDTHxHEIGHT)")
        theirs = f"{req.width}x{req.height}"
        if size not in (None, "auto") and head.limits.parse_size(size) != (req.width, req.height):
            raise InvalidParam("width", req.width, f"width x height = {theirs} differs from size={size!r}; give one")
        size = theirs
    return req.model_copy(update={"frames": frames, "size": size, "num_frames": None, "width": None, "height": None})


def resolve_video(head: ModelHead, req: VideoCreateRequest, image):
    """Params with the frame count from ``frames`` or ``seconds`` (the first count the model accepts)."""
    lim, fps = head.limits, fps_of(head, req)
    if not head.family.is_video:
        raise InvalidParam("model", head.model_id, "is an image model; use POST /v1/images/generations")
    req = fold_peer_names(head, req)
    if req.frames is not None:
        lim.check_frames(req.frames)
        params, size = build_params(head, req, image=image, frames=req.frames)
        return resolve(head, params, size)
    if req.seconds is None:
        params, size = build_params(head, req, image=image)
        return resolve(head, params, size)
    if req.seconds * fps < 1 - 1e-9:  # 1e-300 s is not a one-frame clip
        raise InvalidParam("seconds", req.seconds, f"must be at least {1 / fps:g} (one frame at {fps} fps)")
    target = max(1, math.ceil(req.seconds * fps - 1e-9))
    if target > lim.max_frames:
        rule = f"{target} frames at {fps} fps exceeds the limit of {lim.max_frames}"
        raise InvalidParam("seconds", req.seconds, rule)
    params, size = build_params(head, req, image=image)
    last: InvalidParam | None = None
    for frames in range(target, min(target + FRAME_SEARCH, lim.max_frames) + 1):
        try:
            return resolve(head, params.replace(frames=frames), size, frames_field="seconds")
        except InvalidParam as e:
            if e.field != "seconds":
                raise
            last = e
    raise InvalidParam("seconds", req.seconds, f"no frame count from {target} at {fps} fps fits the model: {last.rule}")


def _schema() -> dict:
    schema = inline_schema(VideoCreateRequest)
    form = json.loads(json.dumps(schema))
    for name in REFERENCE_FIELDS:
        form["properties"][name] = {"type": "string", "format": "binary", "description": "condition image"}
    content = {
        "application/json": {"schema": schema},
        "multipart/form-data": {"schema": form},
        "application/x-www-form-urlencoded": {"schema": form},
    }
    return {"requestBody": {"required": True, "content": content}}


def add_video_routes(app: FastAPI, head: Head) -> None:
    def get_record(video_id: str) -> VideoRecord:
        rec = head.videos.store.get(video_id)
        if rec is None:
            raise HTTPException(404, f"video {shown(video_id)} does not exist")
        return rec

    @app.post("/v1/videos", response_model=VideoObject, openapi_extra=_schema())
    async def create_video(request: Request, response: Response):
        t0 = time.perf_counter()
        req, image = await parse_create(head, request)
        model = head.backend_for(req.model, "video")
        params = resolve_video(model, req, image)
        rec = VideoRecord(
            id=f"video_{secrets.token_hex(12)}",
            created_at=int(time.time()),
            status="queued",
            progress=0,
            model=model.model_id,
            prompt=params.prompt,
            size=f"{params.width}x{params.height}",
            seconds=f"{(params.frames or 1) / fps_of(model, req):g}",
            frames=params.frames or 1,
        )
        job = GenerationJob(
            rec.id,
            params,
            "mp4",
            fps=fps_of(model, req),
            weight=tenant_weight(model),
            **job_deadline(model, req.deadline_s, t0),
        )
        keys = await cache_keys(model, req, [job])
        (stored,) = lookup(model, keys, 1)
        if stored is not None:
            await head.videos.complete(rec, stored, model.backend)
        else:
            model.backend.check_deadlines([job])  # 429 at once when the estimate is past the deadline
            key = keys[0] if keys else None
            head.videos.submit(rec, job, model.backend, model.admission, on_result=lambda data: store(model, key, data))
        model.metrics.record_request("/v1/videos", "success")
        out = to_api(rec)
        notes = model.warnings(params)
        if notes:
            out.warnings = notes
            response.headers[WARNING_HEADER] = header_value(notes)
        return out

    @app.get("/v1/videos", response_model=VideoList)
    async def list_videos(
        limit: int = Query(20, ge=0, le=100, description="0: no videos, has_more says whether any follow"),
        after: str | None = Query(None, max_length=64),
        order: Literal["asc", "desc"] = "desc",
    ):
        recs = head.videos.store.list(limit + 1, after, order)
        data = [to_api(r) for r in recs[:limit]]
        return VideoList(
            data=data,
            has_more=len(recs) > limit,
            first_id=data[0].id if data else None,
            last_id=data[-1].id if data else None,
        )

    @app.get("/v1/videos/{video_id}", response_model=VideoObject)
    async def get_video(video_id: str):
        return to_api(get_record(video_id))

    @app.get("/v1/videos/{video_id}/content", response_class=FileResponse)
    async def video_content(video_id: str, variant: Literal["video"] = "video"):
        rec = get_record(video_id)
        path = head.videos.path(video_id)
        if rec.status != "completed" or not path.is_file():
            raise HTTPException(409, f"video {shown(video_id)} has no content (status {rec.status!r})")
        return FileResponse(path, media_type="video/mp4", filename=f"{video_id}.mp4")

    @app.delete("/v1/videos/{video_id}", response_model=VideoDeleted)
    async def delete_video(video_id: str):
        if not await head.videos.delete(video_id):
            raise HTTPException(404, f"video {shown(video_id)} does not exist")
        return VideoDeleted(id=video_id, deleted=True)
