"""Streamed image generations and edits (``stream=true``): OpenAI's image streaming events.

The response is server-sent events, each ``event: <type>`` plus ``data: <json>``:
``<prefix>.partial_image`` per preview (``b64_json``, ``partial_image_index`` 0, 1, 2, ... in the
order sent, without gaps: a preview lost in transfer or decoded after a newer one is not sent, and
the next one takes its number), then one
``<prefix>.completed`` with the final image and ``usage``; ``<prefix>`` is ``image_generation`` or
``image_edit``. Previews are the clean image the denoiser predicts at evenly spaced steps, decoded
by the decoder pool (``engine.previews``); the final image is the one a non-streamed request
gets, bit for bit. With fewer steps than previews asked for, fewer previews come (OpenAI: "the final
image may be sent before the full number of partial images").

The head never waits on a slow client: the backend hands previews to an unbounded queue that holds
at most ``partial_images`` per attempt, and only this response's generator waits on the socket. The
headers go out with the first event, so a refused request is a proper 4xx/5xx, not a 200 with an
error inside; an error after that is an ``error`` event. A client that disconnects cancels the job
and frees its slots (the generator's ``finally``). No first event within ``request_timeout_s``:
the job is cancelled and the answer is a 504.

A stream answered from the head's result cache (``stream_cached``) is the ``completed`` event
alone: no step runs, so there are no previews.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from triptych.control.backend import GenerationJob
from triptych.core.errors import InvalidParam, TriptychError
from triptych.head.routes_common import deadline, wait_disconnect
from triptych.head.state import WARNING_HEADER, ClientGone, Head, header_value

_CANCELLING: set[asyncio.Task] = set()


def _sse(event: str, body: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


def _error(exc: BaseException) -> bytes:
    if isinstance(exc, InvalidParam):
        error = {"message": f"invalid {exc.field}: {exc.rule}", "type": "invalid_request_error", "param": exc.field}
    else:
        error = {"message": f"generation failed: {exc or type(exc).__name__}", "type": "server_error", "param": None}
    return _sse("error", {"type": "error", "error": error})


def _abandon(head: Head, job: GenerationJob, task: asyncio.Task) -> None:
    """The client is gone (or the request failed): cancel the job in the backend, which frees its
    slots and ends ``task`` (an in-process job stops at its next step, which cancelling the task
    alone would not do). Never awaits: it may run inside a cancelled scope."""
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: nobody awaits it
    if not task.done():
        cancel = asyncio.get_running_loop().create_task(head.backend.cancel(job.request_id))
        _CANCELLING.add(cancel)  # the loop keeps only weak references to tasks
        cancel.add_done_callback(_CANCELLING.discard)


def _completed(prefix: str, data: bytes, common: dict) -> bytes:
    usage = {
        "input_tokens": 0,
        "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
        "output_tokens": 0,
        "total_tokens": 0,
    }
    body = {"type": f"{prefix}.completed", "b64_json": base64.b64encode(data).decode("ascii")}
    return _sse(body["type"], {**body, "created_at": int(time.time()), **common, "usage": usage})


def _headers(warnings: list[str]) -> dict:
    return {"Cache-Control": "no-cache", **({WARNING_HEADER: header_value(warnings)} if warnings else {})}


def _common(output_format: str, size: str) -> dict:
    return {"background": "opaque", "output_format": output_format, "quality": "auto", "size": size}


def stream_cached(
    head: Head,
    data: bytes,
    prefix: str,
    endpoint: str,
    size: str,
    output_format: str,
    t0: float,
    warnings: list[str] = (),
) -> StreamingResponse:
    """A stream answered from the result cache: the ``completed`` event alone (no previews: no step ran)."""
    head.metrics.record_request(endpoint, "success", time.perf_counter() - t0)
    event = _completed(prefix, data, _common(output_format, size))
    return StreamingResponse(iter([event]), media_type="text/event-stream", headers=_headers(warnings))


async def stream_image(
    head: Head,
    request: Request,
    job: GenerationJob,
    prefix: str,
    endpoint: str,
    size: str,
    t0: float,
    warnings: list[str] = (),
    on_result: Callable[[bytes], None] | None = None,
) -> StreamingResponse:
    """Start ``job``; answer with its events once the first is there (see the module docstring);
    ``warnings`` go out in the ``X-Triptych-Warning`` header; ``on_result`` gets the final image once
    the job succeeded (the result cache's store)."""
    queue: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()
    head.admission.reserve(1)
    task = asyncio.create_task(head.backend.run(job, on_preview=lambda i, data: queue.put_nowait((i, data))))
    getter = asyncio.create_task(queue.get())
    watcher = asyncio.create_task(wait_disconnect(request))
    try:
        async with deadline(head, t0):
            await asyncio.wait({task, getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if watcher.done() and not task.done():
            raise ClientGone()
        if task.done() and task.exception() is not None and not getter.done():
            raise task.exception()
    except BaseException:
        head.admission.release(1)
        getter.cancel()
        _abandon(head, job, task)
        raise
    finally:
        watcher.cancel()
    common = _common(job.output_format, size)

    def partial(index: int, data: bytes) -> bytes:
        body = {"type": f"{prefix}.partial_image", "b64_json": base64.b64encode(data).decode("ascii")}
        return _sse(body["type"], {**body, "created_at": int(time.time()), "partial_image_index": index, **common})

    async def events():
        nonlocal getter
        newest = -1  # the newest preview sent (the backend's index): an older or repeated one is not sent
        count = 0  # partials sent: the next one's partial_image_index, so the indices have no gaps

        def fresh(index: int) -> bool:
            nonlocal newest
            if index <= newest:  # a retried job previews again from 0; one decoded late is stale
                return False
            newest = index
            return True

        try:
            while True:
                if getter.done():
                    index, data = getter.result()
                    if fresh(index):
                        yield partial(count, data)
                        count += 1
                    getter = asyncio.create_task(queue.get())
                    continue
                if task.done():
                    break
                await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
            getter.cancel()
            while not queue.empty():
                index, data = queue.get_nowait()
                if fresh(index):
                    yield partial(count, data)
                    count += 1
            try:
                data = task.result()
            except (TriptychError, asyncio.CancelledError) as e:
                head.metrics.record_request(endpoint, "invalid" if isinstance(e, InvalidParam) else "failed")
                yield _error(e)
                return
            head.metrics.record_request(endpoint, "success", time.perf_counter() - t0)
            if on_result is not None:
                on_result(data)
            yield _completed(prefix, data, common)
        finally:
            # Also on a client disconnect, where the response's cancel scope is cancelled and any
            # await here would raise again: nothing below awaits.
            head.admission.release(1)
            getter.cancel()
            _abandon(head, job, task)

    headers = _headers(warnings)
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
