"""Helpers for the HTTP head tests: a real uvicorn server on a free loopback port, fake backends."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from pathlib import Path

import numpy as np
import uvicorn

from triptych.control.backend import Cancelled, GenerationBackend, GenerationJob
from triptych.core.errors import InvalidParam
from triptych.core.media import encode_frames
from triptych.families.base import GenerationParams


@contextlib.contextmanager
def serve(app, start_timeout_s: float = 300.0):
    """Run ``app`` under uvicorn in a thread on 127.0.0.1:<free port>; yields the base URL.
    ``start_timeout_s`` bounds the app's startup (its backends' workers loading and registering: a
    liveness bound; a loaded 2-core machine took over 30 s for three workers)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started or not thread.is_alive(), what="server start", deadline_s=start_timeout_s)
    assert server.started, "uvicorn failed to start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a server a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond, what: str, deadline_s: float = 30.0, every_s: float = 0.02):
    """Poll ``cond`` until true (a liveness bound, not a timing assertion)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}")


CHAT_ANSWER = "a red circle on a blue background"


class FakeBackend(GenerationBackend):
    """Returns a constant frame per job (value from the seed); ``gate`` set → jobs block until opened.
    With ``on_preview``, a job's ``partial_images`` previews (constant frames, value seed + index + 1)
    are handed over first, before the gate.

    ``chat`` answers ``CHAT_ANSWER``: its first piece at once (unless ``chat_first_piece`` is False),
    the rest after the gate.

    Records ``running`` (ids inside ``run``), ``cancelled`` (ids passed to ``cancel``), ``started``.
    """

    def __init__(self, family, gated: bool = False):
        self.family = family
        self.gated = gated
        self.running: set[str] = set()
        self.cancelled: list[str] = []
        self.jobs: list[GenerationJob] = []
        self.chat_first_piece = True
        self.lifecycle: list[str] = []
        self._gate: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cancel_events: dict[str, asyncio.Event] = {}

    async def start(self):
        self._loop = asyncio.get_running_loop()
        self._gate = asyncio.Event()
        if not self.gated:
            self._gate.set()
        self.lifecycle.append("start")

    async def close(self):
        self.lifecycle.append("close")

    def open_gate(self):
        self._loop.call_soon_threadsafe(self._gate.set)

    async def run(self, job, on_progress=None, on_preview=None):
        self.jobs.append(job)
        self.running.add(job.request_id)
        try:
            p = job.params
            for index in range(job.partial_images if on_preview else 0):
                frame = np.full((1, p.height, p.width, 3), (p.seed + index + 1) % 251, dtype=np.uint8)
                on_preview(index, await asyncio.to_thread(encode_frames, frame, job.output_format, job.fps))
            await self._gate_or_cancel(job.request_id)
            total = p.steps or 1
            for step in range(1, total + 1):
                if on_progress:
                    on_progress(step, total)
            frames = np.full(((p.frames or 1), p.height, p.width, 3), p.seed % 251, dtype=np.uint8)
            return await asyncio.to_thread(encode_frames, frames, job.output_format, job.fps)
        finally:
            self.running.discard(job.request_id)

    async def _gate_or_cancel(self, request_id: str) -> None:
        cancel = self._cancel_events.setdefault(request_id, asyncio.Event())
        gate = asyncio.ensure_future(self._gate.wait())
        stop = asyncio.ensure_future(cancel.wait())
        try:
            await asyncio.wait({gate, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gate.cancel(), stop.cancel()
        if cancel.is_set():
            raise Cancelled(request_id)

    async def chat(self, job, on_text=None):
        from triptych.chat import ChatResult

        self.running.add(job.request_id)
        try:
            first, rest = CHAT_ANSWER.split(" ", 1)
            if on_text and self.chat_first_piece:
                on_text(first)
            await self._gate_or_cancel(job.request_id)
            if on_text:
                on_text(" " + rest if self.chat_first_piece else CHAT_ANSWER)
            return ChatResult(CHAT_ANSWER, 5, len(CHAT_ANSWER.split()), "stop")
        except asyncio.CancelledError:  # a caller that goes away cancels the job (``Orchestrator._await``)
            self.cancelled.append(job.request_id)
            raise
        finally:
            self.running.discard(job.request_id)

    async def cancel(self, request_id):
        self.cancelled.append(request_id)
        self._cancel_events.setdefault(request_id, asyncio.Event()).set()
        return True

    def describe(self):
        return {"instances": [{"id": "fake-0", "role": "denoiser", "state": "ready"}], "queues": {"denoise": 0}}


class FakeFamily:
    """Just enough of ``Family`` for the head: geometry defaults and checks (multiples of 16)."""

    def __init__(self, model_dir: Path, is_video=False, accepts_image=False, requires_image=False, chat=False):
        self.name = "fake"
        self.model_dir = Path(model_dir)
        self.is_video, self.accepts_image, self.requires_image = is_video, accepts_image, requires_image
        self.supports_chat = chat

    def resolve(self, p: GenerationParams) -> GenerationParams:
        p = p.replace(
            height=p.height or 32,
            width=p.width or 32,
            steps=p.steps or 2,
            frames=p.frames or (5 if self.is_video else 1),
        )
        for name in ("height", "width"):
            if getattr(p, name) % 16:
                raise InvalidParam(name, getattr(p, name), "must be a positive multiple of 16 for fake")
        if self.is_video and (p.frames - 1) % 4:
            raise InvalidParam("frames", p.frames, "must be 1 + a multiple of 4")
        if p.image is not None and not self.accepts_image:
            raise InvalidParam("image", "<image>", "fake is text-only and takes no image")
        if p.image is None and self.requires_image:
            raise InvalidParam("image", None, "fake needs a condition image")
        return p

    def sequence_tokens(self, p: GenerationParams) -> int:
        return (p.height // 16) * (p.width // 16) * ((p.frames - 1) // 4 + 1)


def png_bytes(width: int = 32, height: int = 32, value: int = 128) -> bytes:
    from triptych.core.media import encode_image

    return encode_image(np.full((height, width, 3), value, dtype=np.uint8), "png")


def decode_pixels(data: bytes) -> np.ndarray:
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))
