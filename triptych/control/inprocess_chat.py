"""The in-process backend's chats: one ``ChatEngine`` (continuous batching, prefix KV), stepped on a
worker thread, the model shared with the backend's generations through its one execution lock.

Each engine step takes the lock on its own (``asyncio.Lock`` is first come, first served), so a
generation that waits gets the model between two steps, as on an encoder instance. New chats and
cancels reach the engine through an inbox that the stepping thread empties at the start of each
step, so the engine is only ever touched by one thread at a time; pieces and results are handed
out on the event loop after the step.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from triptych.chat import ChatResult
from triptych.chat.config import ChatEngineConfig
from triptych.chat.engine import ChatEngine


@dataclass
class _Waiter:
    future: asyncio.Future
    on_text: object


class InProcessChats:
    def __init__(self, model, lock: asyncio.Lock, config: ChatEngineConfig = ChatEngineConfig()):
        self.engine = ChatEngine(model, config)
        self.lock = lock
        self.waiters: dict[str, _Waiter] = {}
        self._inbox: list[tuple] = []  # ("submit", id, params, stream, received) | ("cancel", id)
        self._inbox_lock = threading.Lock()
        self._driver: asyncio.Task | None = None

    def __len__(self) -> int:
        return len(self.waiters)

    async def chat(self, request_id: str, params, stream: bool, on_text) -> ChatResult:
        """The answer (``finish_reason`` cancelled when cancelled); ``on_text`` gets each piece."""
        future = asyncio.get_running_loop().create_future()
        self.waiters[request_id] = _Waiter(future, on_text)
        with self._inbox_lock:
            self._inbox.append(("submit", request_id, params, stream or on_text is not None, time.perf_counter()))
        if self._driver is None or self._driver.done():
            self._driver = asyncio.ensure_future(self._drive())
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            self.cancel(request_id)
            raise

    def cancel(self, request_id: str) -> bool:
        if request_id not in self.waiters:
            return False
        with self._inbox_lock:
            self._inbox.append(("cancel", request_id))
        return True

    def _step(self):
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
        for item in inbox:
            if item[0] == "submit":
                self.engine.submit(*item[1:])
            else:
                self.engine.cancel(item[1])
        return self.engine.step() if self.engine.has_work() else []

    async def _drive(self) -> None:
        while self.waiters:
            async with self.lock:
                touched = await asyncio.to_thread(self._step)
            for chat in touched:
                waiter = self.waiters.get(chat.id)
                if waiter is None:
                    continue
                pieces = list(chat.pieces)
                chat.pieces.clear()  # the engine's streamer appends to this list
                if waiter.on_text is not None:
                    for text in pieces:
                        waiter.on_text(text)
                if chat.done:
                    del self.waiters[chat.id]
                    if not waiter.future.done():
                        if chat.error is not None:
                            waiter.future.set_exception(chat.error)
                        else:
                            waiter.future.set_result(chat.result)
