"""The encoder's client of a vLLM server: chats in, answer pieces out, on a thread beside the loop.

``VllmChatEngine.submit_all([(key, body), ...])`` posts each chat completion (streamed when the caller streams)
as a task on the engine's event-loop thread; ``poll()`` hands the worker loop what arrived since
(``ChatEvent``: a piece of text, the end with its usage, or a failure), ``cancel(key)`` cancels the
task, closing its connection (vLLM aborts a request whose client went away, freeing its KV blocks),
and ``close()`` cancels them all. A chat nobody streams is asked for whole (no per-token traffic). Each arrival calls ``wake`` so an
idle worker loop collects it at once. ``chat_body`` builds the request: text parts as they are,
each image as a precomputed ``image_embeds`` part whose ``uuid`` is the image's mm-hash.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import numpy as np
import torch

from triptych.chat.params import GREEDY_BELOW, ChatParams, ChatResult
from triptych.core.errors import InvalidParam, TriptychError

logger = logging.getLogger(__name__)


class VllmUnavailable(TriptychError):
    """The vLLM server could not be reached (retryable: another encoder, or a later try, may work)."""


def tensor_b64(t: torch.Tensor) -> str:
    """A tensor as vLLM's OpenAI server loads it: base64 of NumPy's ``.npy`` bytes, which vLLM
    recognises by their magic prefix and reads with ``np.load`` (cheaper than ``torch.save`` and vLLM's
    ``torch.load``)."""
    buf = io.BytesIO()
    np.save(buf, t.detach().cpu().contiguous().numpy(), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def chat_body(model: str, params: ChatParams, items: dict, stream: bool = True) -> dict:
    """The OpenAI chat completion request of ``params``; ``items``: image index → ``EmbeddingItem``.
    ``stream=False`` asks for the whole answer at once (no per-token events to relay)."""
    messages = []
    for turn in params.turns:
        content = []
        for part in turn.parts:
            if isinstance(part, int):
                item = items[part]
                tensors = {
                    "image_embeds": tensor_b64(item.image_embeds),
                    "image_grid_thw": tensor_b64(item.image_grid_thw),
                }
                content.append({"type": "image_embeds", "image_embeds": tensors, "uuid": item.uuid})
            else:
                content.append({"type": "text", "text": part})
        messages.append({"role": turn.role, "content": content})
    greedy = params.temperature < GREEDY_BELOW
    return {
        "model": model,
        "messages": messages,
        "max_tokens": params.max_tokens,
        "temperature": 0.0 if greedy else params.temperature,
        "top_p": 1.0 if greedy else params.top_p,
        "seed": params.seed,
        "ignore_eos": params.ignore_eos,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }


@dataclass(frozen=True)
class ChatEvent:
    key: str
    text: str = ""  # a piece of the answer
    result: ChatResult | None = None  # set on the last event of a chat that ended
    error: Exception | None = None  # set on the last event of a chat that failed
    retryable: bool = False


class VllmChatEngine:
    """Ownership: one event-loop thread (started by the first ``submit_all``) runs every chat's request as
    a task; ``cancel`` cancels the task (its connection closes, so vLLM aborts the request, streamed
    or not) and ``close`` cancels them all and stops the thread."""

    def __init__(self, url: str, model: str = "", wake: Callable[[], None] = lambda: None):
        self.url = url.rstrip("/")
        self.wake = wake
        self._events: deque[ChatEvent] = deque()
        self._tasks: dict[str, asyncio.Task | None] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: httpx.AsyncClient | None = None
        self.model = model
        self.max_model_len = 0
        self.items_sent = 0  # image embedding items sent (no pixels ever are)
        self.chats_sent = 0

    def connect(self) -> None:
        """Read the served model and its context from vLLM's ``/v1/models`` (once)."""
        if self.max_model_len:
            return
        try:
            models = httpx.get(f"{self.url}/v1/models", timeout=10.0).json()["data"]
        except (httpx.HTTPError, KeyError, ValueError) as e:
            raise VllmUnavailable(f"vLLM at {self.url} does not answer /v1/models: {e}") from e
        served = next((m for m in models if not self.model or m["id"] == self.model), None)
        if served is None:
            raise VllmUnavailable(f"vLLM at {self.url} does not serve {self.model!r}")
        self.model = served["id"]
        self.max_model_len = int(served.get("max_model_len") or 0)

    def has_events(self) -> bool:
        return bool(self._events)

    def poll(self) -> list[ChatEvent]:
        with self._lock:
            out = list(self._events)
            self._events.clear()
        return out

    def submit_all(self, chats: list[tuple[str, dict]]) -> None:
        """Start every (key, body) of ``chats`` with ONE wake-up of the engine's thread: each wake-up
        hands it the GIL, and the caller waits up to the switch interval to get it back, so
        a step's chats submitted one by one queued behind one another."""
        if not chats:
            return
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="vllm-chats", daemon=True).start()
        for _, body in chats:
            self.chats_sent += 1
            self.items_sent += sum(p.get("type") == "image_embeds" for m in body["messages"] for p in m["content"])
        with self._lock:
            for key, _ in chats:
                self._tasks[key] = None  # started on the loop by _start, unless cancelled first
        self._loop.call_soon_threadsafe(self._start, chats)

    def cancel(self, key: str) -> None:
        with self._lock:
            task = self._tasks.pop(key, None)
        if task is not None:  # the loop cancels the coroutine at its next await
            self._loop.call_soon_threadsafe(task.cancel)

    def running(self) -> int:
        return len(self._tasks)

    def close(self) -> None:
        with self._lock:
            tasks, self._tasks = list(self._tasks.values()), {}
        if self._loop is not None:
            loop, self._loop = self._loop, None
            for task in tasks:
                if task is not None:
                    loop.call_soon_threadsafe(task.cancel)
            if self._client is not None:
                asyncio.run_coroutine_threadsafe(self._client.aclose(), loop)
            loop.call_soon_threadsafe(loop.stop)

    # ---- on the engine's loop ---------------------------------------------------------------------
    def _start(self, chats: list[tuple[str, dict]]) -> None:
        with self._lock:
            for key, body in chats:
                if key in self._tasks:  # not cancelled meanwhile
                    self._tasks[key] = self._loop.create_task(self._run(key, body))

    def _emit(self, event: ChatEvent) -> None:
        with self._lock:
            if event.result is not None or event.error is not None:
                self._tasks.pop(event.key, None)
            self._events.append(event)
        self.wake()

    async def _run(self, key: str, body: dict) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(None, connect=10.0))
        try:
            result = await (self._stream(key, body) if body["stream"] else self._whole(body))
        except httpx.HTTPError as e:
            self._emit(ChatEvent(key, error=VllmUnavailable(f"vLLM at {self.url}: {e}"), retryable=True))
        except TriptychError as e:
            self._emit(ChatEvent(key, error=e))
        else:
            self._emit(ChatEvent(key, result=result))

    async def _whole(self, body: dict) -> ChatResult:
        resp = await self._client.post("/v1/chat/completions", json=body)
        if resp.status_code != 200:
            raise _refusal(resp, body)
        out = resp.json()
        choice, usage = out["choices"][0], out.get("usage") or {}
        text = choice["message"].get("content") or ""
        reason = choice.get("finish_reason") or "length"
        return ChatResult(text, int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)), reason)

    async def _stream(self, key: str, body: dict) -> ChatResult:
        text, reason, usage = [], "length", {}
        async with self._client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise _refusal(resp, body)
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        text.append(piece)
                        self._emit(ChatEvent(key, text=piece))
                    reason = choice.get("finish_reason") or reason
        return ChatResult(
            "".join(text), int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)), reason
        )


def _refusal(resp: httpx.Response, body: dict) -> TriptychError:
    try:
        error = resp.json()
        message = (error.get("error") or error).get("message", resp.text)
    except ValueError:
        message = resp.text
    if resp.status_code == 400 and ("context" in message or "max_tokens" in message or "maximum" in message):
        return InvalidParam("max_tokens", body["max_tokens"], f"vLLM refused it: {message}")
    return TriptychError(f"vLLM answered {resp.status_code}: {message[:500]}")
