"""A real embedded topology (orchestrator + worker processes on loopback) driven from sync tests.

The backend lives on its own event loop thread so one topology can serve several tests of a module.
Waits are liveness bounds (generous deadlines that fail with the last state), never speed checks.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

from triptych.control.backend import GenerationJob
from triptych.control.orchestrator import OrchestratorConfig
from triptych.deploy.launch import EmbeddedBackend, TopologyConfig
from triptych.families.base import GenerationParams

FAST_HEARTBEATS = OrchestratorConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0)


class Cluster:
    def __init__(self, model_dir, topology: TopologyConfig, config: OrchestratorConfig = FAST_HEARTBEATS, **backend):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="cluster-loop", daemon=True)
        self.thread.start()
        self.backend = EmbeddedBackend(model_dir, config, topology, **backend)
        self.call(self.backend.start(), timeout=600)

    def call(self, coro, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def on_loop(self, fn, *args):
        async def run():
            return fn(*args)

        return self.call(run())

    def submit(self, job: GenerationJob, on_progress=None, on_preview=None) -> Future:
        return asyncio.run_coroutine_threadsafe(self.backend.run(job, on_progress, on_preview), self.loop)

    def describe(self) -> dict:
        return self.on_loop(self.backend.describe)

    def wait_until(self, predicate, what: str, timeout: float = 60.0) -> dict:
        end = time.monotonic() + timeout
        while True:
            desc = self.describe()
            if predicate(desc):
                return desc
            if time.monotonic() > end:
                raise AssertionError(f"not reached within {timeout}s: {what}; last state {desc}")
            time.sleep(0.1)

    def close(self) -> None:
        try:
            self.call(self.backend.close(), timeout=120)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


def nothing_held(desc: dict) -> bool:
    """No live request, no charged slot on the head, every worker reports idle with a full pool."""
    if desc["requests"] or any(desc["queues"].values()):
        return False
    for inst in desc["instances"]:
        r = inst["report"]
        if inst["held"] or inst["free"] != inst["capacity"] or not r:
            return False
        if r["active"] or r["engine_running"] or r["free_slots"] != r["max_slots"]:
            return False
    return True


def progress_event(threshold: int):
    """(callback, event): the event is set once a progress report reaches ``threshold`` steps."""
    event = threading.Event()

    def on_progress(step: int, total: int) -> None:
        if step >= threshold:
            event.set()

    return on_progress, event


def job(family, rid: str, seed: int = 0, steps: int | None = None, fmt: str = "png") -> GenerationJob:
    params = family.resolve(GenerationParams(f"a photo of object {seed}", seed=seed, steps=steps))
    return GenerationJob(rid, params, fmt)


def holder_of(desc: dict, request_id: str, role: str) -> str:
    (iid,) = [i["id"] for i in desc["instances"] if i["role"] == role and request_id in i["held"]]
    return iid
