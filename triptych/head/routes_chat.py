"""``POST /v1/chat/completions``: chat about images with the model's VLM (the understanding path).

The request is checked here (roles, images, lengths, the head's token and image limits) and turned
into ``ChatParams``; images arrive as base64 ``data:`` URLs and are decoded under the same limits as
uploads. The backend runs it on a chat-capable encoder instance (the orchestrator) or in process.
What only the model can check (prompt tokens + ``max_tokens`` within its context) comes back as a 400
too: a streamed response does not send its headers until the first piece of the answer (or an error)
is there, so a refused request is never a 200 with an error inside.

Streaming follows OpenAI's server-sent events: a first chunk with the assistant role, one chunk per
decoded piece, a last chunk with ``finish_reason``, a usage chunk when
``stream_options.include_usage`` is set, then ``data: [DONE]``. A client that disconnects cancels
the chat: the worker stops at its next token and frees its slot. An answer (a stream: its first
piece) not there within ``request_timeout_s`` is cancelled too, and answered 504.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from triptych.chat import ChatParams, ChatResult, ChatTurn
from triptych.control.backend import ChatJob
from triptych.control.metrics_chat import ChatClock
from triptych.core import offload
from triptych.core.chat_sampling import ChatSampling
from triptych.core.errors import InvalidParam, TriptychError
from triptych.core.media import decode_data_url
from triptych.head.api_models import ChatChoice, ChatCompletion, ChatCompletionRequest, ChatMessageOut, ChatUsage
from triptych.head.chat_video import marker, video_frames
from triptych.head.routes_common import deadline, wait_disconnect
from triptych.head.state import TENANT, ClientGone, DeadlineExceeded, Head, ModelHead

ENDPOINT = "/v1/chat/completions"
DEFAULT_MAX_TOKENS = ChatSampling.max_tokens
#: OpenAI fields the server does not implement, with the value that means "not used".
UNSUPPORTED = {
    "n": 1,
    "stop": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": None,
    "logprobs": False,
    "top_logprobs": None,
    "tools": None,
    "tool_choice": None,
    "parallel_tool_calls": None,
}


def build_chat(head: ModelHead, req: ChatCompletionRequest) -> tuple[ChatParams, float]:
    """API request → checked ``ChatParams`` and the seconds its images took to decode (decodes the
    images: run it off the event loop)."""
    lim = head.limits
    head.check_model(req.model)
    for name, unused in UNSUPPORTED.items():
        value = getattr(req, name)
        if value not in (None, unused) and value != [] and value != {}:
            raise InvalidParam(name, value, f"is not supported by this server (leave it unset or {unused!r})")
    if req.response_format is not None and req.response_format.get("type", "text") != "text":
        raise InvalidParam("response_format", req.response_format, "only {'type': 'text'} is supported")
    if (
        req.max_tokens is not None
        and req.max_completion_tokens is not None
        and req.max_tokens != req.max_completion_tokens
    ):
        raise InvalidParam(
            "max_tokens", req.max_tokens, f"differs from max_completion_tokens={req.max_completion_tokens}"
        )
    max_tokens = req.max_completion_tokens or req.max_tokens or min(DEFAULT_MAX_TOKENS, lim.max_chat_tokens)
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    if max_tokens > lim.max_chat_tokens:
        raise InvalidParam(field, max_tokens, f"must be at most {lim.max_chat_tokens} (the server's max_chat_tokens)")
    turns, images, chars, visuals, decode_s = [], [], 0, 0, 0.0
    for i, message in enumerate(req.messages):
        role = "system" if message.role == "developer" else message.role
        content = [message.content] if isinstance(message.content, str) else message.content
        parts: list[str | int] = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif part.type == "text":
                parts.append(part.text)
            else:
                if role != "user":
                    raise InvalidParam(
                        f"messages[{i}].content[{j}]", part.type, "images and videos are accepted in user messages only"
                    )
                if visuals >= lim.max_chat_images:
                    raise InvalidParam(
                        f"messages[{i}].content[{j}]",
                        "image_url",
                        f"at most {lim.max_chat_images} images and videos per request (max_chat_images)",
                    )
                visuals += 1
                if part.type == "video_url":  # its sampled frames, each an image after its time
                    start = time.perf_counter()
                    frames = video_frames(head, part, f"messages[{i}].content[{j}].video_url")
                    decode_s += time.perf_counter() - start
                    for frame in frames:
                        images.append(frame.image)
                        parts += [marker(frame), len(images) - 1]
                    continue
                field_name = f"messages[{i}].content[{j}].image_url.url"
                start = time.perf_counter()
                images.append(decode_data_url(part.image_url.url, lim.image_limits, field_name))
                decode_s += time.perf_counter() - start
                parts.append(len(images) - 1)
            chars += len(parts[-1]) if isinstance(parts[-1], str) else 0
        if not any(isinstance(p, int) or p.strip() for p in parts):  # as a blank prompt is refused
            shown_content = message.content if isinstance(message.content, str) else list(parts)
            raise InvalidParam(
                f"messages[{i}].content", shown_content, "must have non-whitespace text, an image or a video"
            )
        turns.append(ChatTurn(role, tuple(parts)))
    if chars > lim.max_prompt_chars:
        raise InvalidParam("messages", f"<{chars} characters>", f"must total at most {lim.max_prompt_chars} characters")
    seed = req.seed if req.seed is not None else secrets.randbelow(2**31)
    temperature = 0.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    params = ChatParams(
        tuple(turns), tuple(images), max_tokens, temperature, top_p, seed, bool(req.ignore_eos), TENANT.get()
    )
    params.check(lim.max_chat_images * lim.max_chat_video_frames)  # a video's frames are images
    return params, decode_s


def _sse(payload: dict | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


def _error_event(exc: BaseException) -> dict:
    if isinstance(exc, InvalidParam):
        return {
            "error": {
                "message": f"invalid {exc.field}: {exc.rule}",
                "type": "invalid_request_error",
                "param": exc.field,
                "code": "invalid_value",
            }
        }
    return {"error": {"message": f"chat failed: {exc}", "type": "server_error", "param": None, "code": "stage_failed"}}


async def _answer(head: ModelHead, request: Request, job: ChatJob, t0: float) -> ChatResult:
    """The whole answer; a client disconnect cancels the chat (``ClientGone``), so does the deadline
    (``DeadlineExceeded``)."""
    task = asyncio.create_task(head.backend.chat(job))
    watcher = asyncio.create_task(wait_disconnect(request))
    try:
        try:
            async with deadline(head, t0):
                await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except DeadlineExceeded:
            await _stop(head, job, task)
            raise
        if not task.done():
            await _stop(head, job, task)
            raise ClientGone()
        return task.result()
    finally:
        watcher.cancel()
        task.cancel()  # a no-op when it finished; otherwise the backend's chat frees what it holds


async def _stop(head: ModelHead, job: ChatJob, task: asyncio.Task) -> None:
    await head.backend.cancel(job.request_id)
    await asyncio.gather(task, return_exceptions=True)


def _record(head: ModelHead, result: ChatResult, t0: float, clock: ChatClock) -> None:
    clock.finished(result)
    head.metrics.record_request(ENDPOINT, "success", time.perf_counter() - t0)
    head.metrics.record_chat(result.prompt_tokens, result.completion_tokens)


async def _stream(
    head: ModelHead, request: Request, job: ChatJob, model: str, include_usage: bool, t0: float, clock: ChatClock
) -> StreamingResponse:
    """Start the chat, wait for its first piece (or its end, or its error: raised here, so the client
    gets a proper status; or the client leaving, or the deadline), then stream the rest."""
    pieces: asyncio.Queue[str] = asyncio.Queue()
    head.admission.reserve(1)
    task = asyncio.create_task(head.backend.chat(job, on_text=pieces.put_nowait))
    getter = asyncio.create_task(pieces.get())
    watcher = asyncio.create_task(wait_disconnect(request))
    try:
        async with deadline(head, t0):
            await asyncio.wait({task, getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if watcher.done() and not task.done() and not getter.done():
            raise ClientGone()
        if task.done() and task.exception() is not None and not getter.done():
            raise task.exception()
    except BaseException:
        head.admission.release(1)
        getter.cancel()
        task.cancel()  # the backend's chat cleans up on its own (frees the worker's slot)
        raise
    finally:
        watcher.cancel()
    created = int(time.time())

    def piece(text: str) -> bytes:
        clock.piece()
        return chunk({"content": text})

    def chunk(delta: dict, finish: str | None = None) -> bytes:
        return _sse(
            {
                "id": job.request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
        )

    async def events():
        nonlocal getter
        try:
            yield chunk({"role": "assistant", "content": ""})
            while True:
                if getter.done():
                    yield piece(getter.result())
                    getter = asyncio.create_task(pieces.get())
                    continue
                if task.done():
                    break
                await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
            getter.cancel()
            while not pieces.empty():
                yield piece(pieces.get_nowait())
            try:
                result = task.result()
            except (TriptychError, asyncio.CancelledError) as e:
                head.metrics.record_request(ENDPOINT, "invalid" if isinstance(e, InvalidParam) else "failed")
                yield _sse(_error_event(e))
                return
            _record(head, result, t0, clock)
            yield chunk({}, result.finish_reason)
            if include_usage:
                usage = {
                    "prompt_tokens": result.prompt_tokens,
                    "completion_tokens": result.completion_tokens,
                    "total_tokens": result.prompt_tokens + result.completion_tokens,
                }
                yield _sse(
                    {
                        "id": job.request_id,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": usage,
                    }
                )
            yield _sse("[DONE]")
        finally:
            # Also on a client disconnect, where the response's cancel scope is cancelled and any
            # await here would raise again: nothing below awaits. Cancelling the backend's chat task
            # stops the worker at its next token and frees its slot.
            head.admission.release(1)
            getter.cancel()
            task.cancel()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def add_chat_routes(app: FastAPI, head: Head) -> None:
    @app.post(ENDPOINT, response_model=ChatCompletion)
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        t0 = time.perf_counter()
        model = head.backend_for(req.model, "chat")
        if not model.family.supports_chat:
            raise InvalidParam(
                "model", model.model_id, f"({model.family.name}) has no VLM to chat with (no processor/)"
            )
        if req.stream_options is not None and not req.stream:
            raise InvalidParam("stream_options", req.stream_options.model_dump(), "is only allowed with stream=true")
        params, decode_s = await offload.run(build_chat, model, req)
        clock = ChatClock(model.metrics.chat_latency, t0, decode_s)
        tenant = model.tenants.policy(TENANT.get())
        priority = model.tenants.priority(req.priority, TENANT.get())
        job = ChatJob(
            f"chatcmpl-{secrets.token_hex(12)}", params, bool(req.stream), priority=priority, weight=tenant.weight
        )
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if job.stream:
            return await _stream(model, request, job, model.model_id, include_usage, t0, clock)
        with model.admission.admit(1):
            result = await _answer(model, request, job, t0)
        _record(model, result, t0, clock)
        usage = ChatUsage(
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            total_tokens=result.prompt_tokens + result.completion_tokens,
        )
        return ChatCompletion(
            id=job.request_id,
            created=int(time.time()),
            model=model.model_id,
            usage=usage,
            choices=[
                ChatChoice(index=0, message=ChatMessageOut(content=result.text), finish_reason=result.finish_reason)
            ],
            seed=params.seed,
        )
