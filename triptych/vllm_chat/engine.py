"""The encoder's client of a vLLM server: chats in, answer pieces out, on threads beside the loop.

``VllmChatEngine.submit(key, body)`` posts one streaming chat completion on a thread of its own;
``poll()`` hands the loop what arrived since (``ChatEvent``: a piece of text, the end with its usage,
or a failure), ``cancel(key)`` closes that request's connection (vLLM aborts a request whose client
went away, freeing its KV blocks) and ``close()`` cancels them all. Each arrival calls ``wake`` so an
idle worker loop collects it at once. ``chat_body`` builds the request: text parts as they are,
each image as a precomputed ``image_embeds`` part whose ``uuid`` is the image's mm-hash.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import torch

from triptych.errors import InvalidParam, TriptychError
from triptych.pipelines.vlm import ChatParams, ChatResult
from triptych.pipelines.vlm.chat import GREEDY_BELOW

logger = logging.getLogger(__name__)


class VllmUnavailable(TriptychError):
    """The vLLM server could not be reached (retryable: another encoder, or a later try, may work)."""


def tensor_b64(t: torch.Tensor) -> str:
    """A tensor as vLLM's OpenAI server loads it (``torch.load`` of base64 bytes, weights only)."""
    buf = io.BytesIO()
    torch.save(t.contiguous(), buf)
    return base64.b64encode(buf.getvalue()).decode()


def chat_body(model: str, params: ChatParams, items: dict) -> dict:
    """The OpenAI chat completion request of ``params``; ``items``: image index → ``EmbeddingItem``."""
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
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass(frozen=True)
class ChatEvent:
    key: str
    text: str = ""  # a piece of the answer
    result: ChatResult | None = None  # set on the last event of a chat that ended
    error: Exception | None = None  # set on the last event of a chat that failed
    retryable: bool = False


class VllmChatEngine:
    """Ownership: one thread per running chat; ``cancel``/``close`` end them, each joins on its own."""

    def __init__(self, url: str, model: str = "", wake: Callable[[], None] = lambda: None):
        self.url = url.rstrip("/")
        self.wake = wake
        self._client = httpx.Client(base_url=self.url, timeout=httpx.Timeout(None, connect=10.0))
        self._events: deque[ChatEvent] = deque()
        self._cancel: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self.model = model
        self.max_model_len = 0
        self.items_sent = 0  # image embedding items sent (no pixels ever are)
        self.chats_sent = 0

    def connect(self) -> None:
        """Read the served model and its context from vLLM's ``/v1/models`` (once)."""
        if self.max_model_len:
            return
        try:
            models = self._client.get("/v1/models", timeout=10.0).json()["data"]
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

    def submit(self, key: str, body: dict) -> None:
        stop = threading.Event()
        with self._lock:
            self._cancel[key] = stop
        self.chats_sent += 1
        self.items_sent += sum(p.get("type") == "image_embeds" for m in body["messages"] for p in m["content"])
        threading.Thread(target=self._run, args=(key, body, stop), name=f"vllm-{key}", daemon=True).start()

    def cancel(self, key: str) -> None:
        with self._lock:
            stop = self._cancel.pop(key, None)
        if stop is not None:
            stop.set()

    def running(self) -> int:
        return len(self._cancel)

    def close(self) -> None:
        with self._lock:
            stops, self._cancel = list(self._cancel.values()), {}
        for stop in stops:
            stop.set()

    # ---- a chat's thread -------------------------------------------------------------------------
    def _emit(self, event: ChatEvent) -> None:
        with self._lock:
            if event.result is not None or event.error is not None:
                self._cancel.pop(event.key, None)
            self._events.append(event)
        self.wake()

    def _run(self, key: str, body: dict, stop: threading.Event) -> None:
        try:
            result = self._stream(key, body, stop)
        except httpx.HTTPError as e:
            self._emit(ChatEvent(key, error=VllmUnavailable(f"vLLM at {self.url}: {e}"), retryable=True))
            return
        except TriptychError as e:
            self._emit(ChatEvent(key, error=e))
            return
        if result is not None:  # None: cancelled, nobody waits for it
            self._emit(ChatEvent(key, result=result))

    def _stream(self, key: str, body: dict, stop: threading.Event) -> ChatResult | None:
        text, reason, usage = [], "length", {}
        with self._client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                raise _refusal(resp, body)
            for line in resp.iter_lines():
                if stop.is_set():
                    return None  # leaving the block closes the connection: vLLM aborts the request
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
        if stop.is_set():
            return None
        return ChatResult(
            "".join(text), int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)), reason
        )


def _refusal(resp: httpx.Response, body: dict) -> TriptychError:
    resp.read()
    try:
        error = resp.json()
        message = (error.get("error") or error).get("message", resp.text)
    except ValueError:
        message = resp.text
    if resp.status_code == 400 and ("context" in message or "max_tokens" in message or "maximum" in message):
        return InvalidParam("max_tokens", body["max_tokens"], f"vLLM refused it: {message}")
    return TriptychError(f"vLLM answered {resp.status_code}: {message[:500]}")
