"""One chat answer, one token at a time, on the encoder's loop.

transformers' ``generate`` runs to the end of an answer; the worker loop must keep serving its
control socket, its encodes and its transfers between tokens. ``ChatSession`` runs ``generate`` on
a thread of its own in strict alternation with the loop: ``step()`` lets the answer advance by one
token and returns when it has (or when the answer ended). The model is never used by two threads at
once, so a seeded answer is the same as one generated in one go (encodes in between draw no random
numbers), and the loop never runs inside ``generate``.
"""

from __future__ import annotations

import threading

from triptych.pipelines.vlm import ChatParams, ChatResult


class ChatSession:
    """Ownership: the session owns its thread; ``close()`` (or the answer's end) joins it."""

    def __init__(self, model, params: ChatParams, stream: bool):
        self._model = model
        self._params = params
        self._stream = stream
        self.pieces: list[str] = []  # decoded pieces not yet sent (drained by the runner)
        self.result: ChatResult | None = None
        self.error: BaseException | None = None
        self._cancel = False
        self._go = threading.Semaphore(0)
        self._back = threading.Semaphore(0)
        self._done = False
        self._thread = threading.Thread(target=self._main, name="chat", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return self._done

    def step(self) -> None:
        """Let the answer advance by one token (or to its end); blocks until it has."""
        if self._done:
            return
        self._go.release()
        self._back.acquire()
        if self._done:
            self._thread.join()

    def close(self) -> None:
        """Stop at the next token and join the thread (idempotent)."""
        self._cancel = True
        while not self._done:
            self.step()

    # ---- the session's thread -------------------------------------------------------------------
    def _main(self) -> None:
        self._go.acquire()
        try:
            on_text = self.pieces.append if self._stream else None
            self.result = self._model.run(self._params, on_text, self._pause)
        except BaseException as e:  # noqa: BLE001 - handed to the loop thread, which reports it
            self.error = e
        finally:
            self._done = True
            self._back.release()

    def _pause(self) -> bool:
        """Between tokens: hand the turn back to the loop, wait for the next one; True = stop."""
        self._back.release()
        self._go.acquire()
        return self._cancel
