"""One simulated window: requests arriving on their own clock into a ``SimCluster``.

``simulate`` sends each ``Arrival`` at its time in ``mode`` ``slo`` (its class's priority, and its
SLO as ``deadline_s`` for images) or ``fcfs`` (priority 0, no deadline: the same arrivals judged
against the same SLOs), runs the virtual clock until ``drain_s`` after the last arrival, and
returns one ``Record`` per arrival (status 0: no answer by then) with the cluster for its
counters. Latency is from the arrival to the answer, the cost model's overhead included. The
router makes asyncio futures, so a call outside a running event loop runs inside a fresh one
(nothing is awaited: the clock is virtual).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

from triptych.sim.cluster import ClusterConfig, SimCluster, SimParams
from triptych.sim.costs import CostModel
from triptych.sim.report import Record
from triptych.sim.workload import PRIORITY, Spec


@dataclass(frozen=True)
class Arrival:
    t: float
    spec: Spec
    slo_s: float
    tenant: str = ""


def simulate(
    costs: CostModel, config: ClusterConfig, arrivals: list[Arrival], mode: str, drain_s: float
) -> tuple[list[Record], SimCluster]:
    if mode not in ("slo", "fcfs"):
        raise ValueError(f"mode={mode!r} must be 'slo' or 'fcfs'")
    try:
        asyncio.get_running_loop()
    except RuntimeError:

        async def inside():
            return _simulate(costs, config, arrivals, mode, drain_s)

        return asyncio.run(inside())
    return _simulate(costs, config, arrivals, mode, drain_s)


def _simulate(costs, config, arrivals, mode, drain_s):
    cluster = SimCluster(costs, config)
    loop = cluster.loop
    records: list[Record | None] = [None] * len(arrivals)

    def send(k: int) -> None:
        a = arrivals[k]
        spec = a.spec
        if spec.cls == "chat":

            def chat_done(k=k, a=a) -> None:
                records[k] = Record(a.spec.cls, 200, loop.now - a.t, a.slo_s)

            return cluster.chat(0, chat_done)
        priority = PRIORITY[spec.cls] if mode == "slo" else 0
        deadline = a.slo_s if mode == "slo" else None
        params = SimParams(spec.size, spec.size, spec.steps, priority, a.tenant)

        def done(rid: str, status: int, end: float, k=k, a=a) -> None:
            extra = costs.overhead_s if status == 200 else 0.0
            records[k] = Record(a.spec.cls, status, end + extra - a.t, a.slo_s)

        cluster.submit(f"r{k}", params, deadline, done)

    for k, a in enumerate(arrivals):
        loop.at(a.t, lambda k=k: send(k))
    horizon = (arrivals[-1].t if arrivals else 0.0) + drain_s
    loop.run(until=horizon)
    out = [r if r is not None else Record(a.spec.cls, 0, horizon - a.t, a.slo_s) for r, a in zip(records, arrivals)]
    return out, cluster


def closed_loop(costs: CostModel, config: ClusterConfig, specs: list[Spec], clients: int, seconds: float) -> float:
    """Requests/s answered 200 over ``seconds`` with ``clients`` each sending the next of ``specs``
    (FCFS, no deadlines) as soon as its last one was answered: goodput.py's capacity phase."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:

        async def inside():
            return closed_loop(costs, config, specs, clients, seconds)

        return asyncio.run(inside())
    cluster = SimCluster(costs, config)
    loop, it, done = cluster.loop, iter(specs), [0]

    def send() -> None:
        if loop.now >= seconds:
            return
        spec = next(it)
        if spec.cls == "chat":
            return cluster.chat(0, lambda: finished(200))
        params = SimParams(spec.size, spec.size, spec.steps)
        cluster.submit(f"c{next(counter)}", params, None, lambda rid, status, end: finished(status))

    def finished(status: int) -> None:
        if loop.now <= seconds:
            done[0] += status == 200
        loop.after(costs.overhead_s if status == 200 else 0.0, send)

    counter = itertools.count()
    for _ in range(clients):
        loop.at(0.0, send)
    loop.run(until=seconds)
    return done[0] / seconds
