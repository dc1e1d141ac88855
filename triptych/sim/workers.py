"""Simulated workers: they take the head's real task messages and answer with the real reply
messages after the cost model's virtual seconds.

- ``SimStage`` (an encoder or a decoder): one task at a time, its queue ordered by (priority,
  arrival) as a worker's stage queue is. An encoder answers ``EncodeTask`` with ``EncodeDone``
  after ``encode_s`` and holds the conditioning until the head's ``PushTask`` (answered with
  ``PushDone`` at once: transfers cost nothing here, the per-request overhead stands for them). A
  decoder answers ``DecodeTask`` with ``SlotsReserved`` at once (the head then has the denoiser push
  the latents) and ``MediaResult`` after ``decode_s``. A chat (``chat``) takes ``chat_s`` of an
  encoder's time in the same queue.
- ``SimDenoiser``: continuous step batching with the engine's own scheduler. A ``DenoiseTask`` is
  answered with ``SlotsReserved`` and the request joins at the next step boundary; each tick runs
  ``engine.scheduler.pick_batch`` over the running requests (``Running`` records, the real
  ``EngineConfig``), costs ``tick(shape, len(batch))`` and counts the requests
  ``engine.scheduler.displaced`` names (those the engine would park) in ``preemptions``; a request
  done after its last step answers ``DenoiseDone`` with its mean tick seconds and occupancy (as the
  denoiser runner reports them) and holds its latents until ``PushTask``.

``Cancel`` drops a request's task or state wherever it is. ``send(msg)`` delivers a reply to the head.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from triptych.control import protocol as P
from triptych.engine.config import EngineConfig
from triptych.engine.scheduler import Running, displaced, pick_batch
from triptych.sim.costs import CostModel
from triptych.sim.loop import EventLoop

Send = Callable[[P.WorkerReply], None]


def _shape(p) -> tuple[int, int]:
    return (int(p.height), int(p.width))


class SimStage:
    def __init__(self, instance_id: str, kind: str, loop: EventLoop, costs: CostModel, send: Send):
        self.instance_id, self.kind = instance_id, kind
        self.loop, self.costs, self.send = loop, costs, send
        self._queue: list[tuple[int, int, tuple]] = []
        self._seq = itertools.count()
        self._busy = False
        self._cancelled: set[tuple[str, int]] = set()
        self.busy_s = 0.0

    def receive(self, msg) -> None:
        if isinstance(msg, P.EncodeTask):
            self._enqueue(msg.params.priority, ("encode", msg.request_id, msg.generation, None, self.costs.encode_s))
        elif isinstance(msg, P.DecodeTask):
            self.send(P.SlotsReserved(**self._ids(msg), handoff="latents", refs={}))
            cost = self.costs.decode_s[_shape(msg.params)]
            self._enqueue(msg.params.priority, ("decode", msg.request_id, msg.generation, msg.output_format, cost))
        elif isinstance(msg, P.PushTask):
            self.send(P.PushDone(**self._ids(msg), handoff=msg.handoff))
        elif isinstance(msg, P.Cancel):
            self._cancelled.add((msg.request_id, msg.generation))

    def chat(self, priority: int, done: Callable[[], None]) -> None:
        """A chat in this encoder's queue: ``done()`` after ``chat_s`` of its time."""
        self._enqueue(priority, ("chat", "", 0, done, self.costs.chat_s))

    @property
    def queued(self) -> int:
        return len(self._queue) + self._busy

    def _ids(self, msg) -> dict:
        return {"request_id": msg.request_id, "generation": msg.generation, "instance_id": self.instance_id}

    def _enqueue(self, priority: int, task: tuple) -> None:
        heapq.heappush(self._queue, (priority, next(self._seq), task))
        if not self._busy:
            self._next()

    def _next(self) -> None:
        while self._queue:
            _, _, task = heapq.heappop(self._queue)
            what, rid, generation, extra, cost = task
            if (rid, generation) in self._cancelled:
                self._cancelled.discard((rid, generation))
                continue
            self._busy = True
            self.busy_s += cost
            self.loop.after(cost, lambda task=task: self._done(task))
            return
        self._busy = False

    def _done(self, task: tuple) -> None:
        what, rid, generation, extra, _ = task
        ids = {"request_id": rid, "generation": generation, "instance_id": self.instance_id}
        if what == "chat":
            extra()
        elif (rid, generation) in self._cancelled:
            self._cancelled.discard((rid, generation))
        elif what == "encode":
            self.send(P.EncodeDone(**ids, specs={}))
        else:
            self.send(P.MediaResult(**ids, data=b"", output_format=extra))
        self._next()


@dataclass(frozen=True)
class _Cond:
    branches: tuple = ("cond",)  # one row per request: the tokens budget is far from binding here


_COND = _Cond()


@dataclass
class SimState:
    """What ``pick_batch`` and the tick read of a request's ``DenoiseState``."""

    request_id: str
    generation: int
    shape: tuple[int, int]
    total_steps: int
    priority: int = 0
    cond: object = field(default_factory=lambda: _COND)
    step: int = 0
    ticks: list = field(default_factory=lambda: [0, 0.0, 0])  # ticks, seconds, requests stepped beside it


class SimDenoiser:
    def __init__(self, instance_id: str, loop: EventLoop, costs: CostModel, config: EngineConfig, send: Send):
        self.instance_id = instance_id
        self.loop, self.costs, self.config, self.send = loop, costs, config, send
        self.running: dict[str, Running] = {}
        self._joining: list[SimState] = []
        self._holding: dict[str, int] = {}  # finished, latents held until their push: rid -> generation
        self._tick = 0
        self._arrivals = itertools.count()
        self._busy = False
        self.preemptions = 0
        self.ticks = 0
        self.busy_s = 0.0
        self.request_steps = 0

    def receive(self, msg) -> None:
        if isinstance(msg, P.DenoiseTask):
            p = msg.params
            ids = {"request_id": msg.request_id, "generation": msg.generation, "instance_id": self.instance_id}
            self.send(P.SlotsReserved(**ids, handoff="cond", refs={}))
            self._joining.append(SimState(msg.request_id, msg.generation, _shape(p), int(p.steps), int(p.priority)))
            if not self._busy:
                self._start_tick()
        elif isinstance(msg, P.PushTask):
            if self._holding.pop(msg.request_id, None) is not None:
                ids = {"request_id": msg.request_id, "generation": msg.generation, "instance_id": self.instance_id}
                self.send(P.PushDone(**ids, handoff=msg.handoff))
        elif isinstance(msg, P.Cancel):
            rid = msg.request_id
            self._joining = [s for s in self._joining if s.request_id != rid]
            self.running.pop(rid, None)
            self._holding.pop(rid, None)

    @property
    def load(self) -> int:
        return len(self.running) + len(self._joining)

    def _start_tick(self) -> None:
        for s in self._joining:  # arrivals join at this step boundary
            self.running[s.request_id] = Running(s, s.shape, 1, self._tick, next(self._arrivals), s.priority)
        self._joining = []
        batch = pick_batch(list(self.running.values()), self.config)
        if not batch:
            self._busy = False
            return
        self.preemptions += len(displaced(list(self.running.values()), batch, self.config))
        cost = self.costs.tick(batch[0].key, len(batch))
        self._busy = True
        self.busy_s += cost
        self.loop.after(cost, lambda: self._end_tick(batch, cost))

    def _end_tick(self, batch: list[Running], cost: float) -> None:
        self._tick += 1
        self.ticks += 1
        for r in batch:
            s = r.state
            if self.running.get(s.request_id) is not r:
                continue  # cancelled during the tick
            r.last_tick = self._tick
            s.step += 1
            self.request_steps += 1
            s.ticks[0] += 1
            s.ticks[1] += cost
            s.ticks[2] += len(batch)
            if s.step >= s.total_steps:
                del self.running[s.request_id]
                self._holding[s.request_id] = s.generation
                n, seconds, requests = s.ticks
                self.send(
                    P.DenoiseDone(
                        request_id=s.request_id,
                        generation=s.generation,
                        instance_id=self.instance_id,
                        specs={},
                        tick_s=seconds / n,
                        occupancy=requests / n,
                    )
                )
        self._start_tick()
