"""The head's CPU work on request bodies, off its event loop: one small bounded pool of threads.

Parsing a large JSON body, decoding a base64 data URL, decoding and checking an uploaded image and
re-encoding it as PNG for the wire take seconds for a 60 MiB body. On the event loop they stall
everything else the head does meanwhile: other requests, and the control plane, whose heartbeats
then go unread until every worker is declared dead. ``run(fn, *args)`` runs such work in the pool and
awaits it, so the loop keeps turning (the GIL is handed back to it every switch interval, and
Pillow, zlib and hashlib release it while they work).

One pool per process, ``HeadConfig.media_threads`` threads (``configure``, called by ``create_app``):
the threads share the process's cores (and its GIL) whichever model a request is for. Bounded, so
a burst of large uploads queues here instead of multiplying its memory and its CPU share.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from concurrent.futures import ThreadPoolExecutor

DEFAULT_THREADS = 2

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_threads = DEFAULT_THREADS


def configure(threads: int) -> None:
    """Size the pool (``HeadConfig.media_threads``); work already queued finishes on the old one."""
    global _pool, _threads
    if threads < 1:
        raise ValueError(f"media threads={threads!r}: must be >= 1")
    with _lock:
        if threads == _threads and _pool is not None:
            return
        old, _pool, _threads = _pool, None, threads
    if old is not None:
        old.shutdown(wait=False)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_threads, thread_name_prefix="head-media")
        return _pool


async def run(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in the pool; its result or its exception, here."""
    return await asyncio.get_running_loop().run_in_executor(_executor(), functools.partial(fn, *args, **kwargs))
