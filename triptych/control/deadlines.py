"""A generation's deadline at its admission: the estimate of when it would finish if queued now
(the work ahead of it and the learned step costs, ``step_costs``) against its ``deadline_s``;
refused at once (``DeadlineRefused``) when it is past. (A deadline that passes while the request
waits is the lifecycle's: ``Lifecycle.expire``.)"""

from __future__ import annotations

from typing import TYPE_CHECKING

from triptych.control.backend import DeadlineRefused, GenerationJob
from triptych.control.request_state import RequestState
from triptych.control.step_costs import Shape, finish_estimate, occupancy, shape_of
from triptych.core.kinds import Role

if TYPE_CHECKING:
    from triptych.control.routing import GenerationRouter

S = RequestState


def estimate(router: GenerationRouter, jobs: list[GenerationJob], now: float) -> tuple[float, int, int]:
    """When the last of ``jobs`` (one request's, none queued yet) would finish denoising if queued
    now: (seconds, requests ahead, denoiser slots). Ahead: every request placed or denoising (its
    steps left, from the time it has denoised at its shape's cost at the occupancy they all make)
    and every queued one of the same priority class or before; the earlier of ``jobs`` too."""
    costs, priority = router.costs, jobs[0].params.priority
    key = router.wait_encode.key
    live = []
    for rid, tr in router.requests.items():
        state = tr.machine.state
        if state is S.DECODING or state is S.QUEUED and key(rid).priority > priority:
            continue
        live.append(tr)
    pool = [i for i in router.registry.pool(Role.DENOISER) if not i.draining]
    slots = sum(i.capacity for i in pool)
    n = occupancy(len(live) + len(jobs) - 1, slots, len(pool))
    step: dict[Shape, float] = {}  # shape -> costs.step_s(shape, n): a handful of shapes, many requests
    ahead: list[tuple[Shape, float]] = []
    for tr in live:
        p = tr.job.params
        shape = shape_of(p)
        steps = float(p.steps)
        if tr.machine.state is S.DENOISING:
            cost = step.get(shape)
            if cost is None:
                cost = step[shape] = costs.step_s(shape, n)
            steps -= (now - tr.machine.entered_at) / cost
        ahead.append((shape, steps))
    ahead.extend((shape_of(j.params), float(j.params.steps)) for j in jobs[:-1])
    last = jobs[-1].params
    seconds = finish_estimate(costs, ahead, (shape_of(last), last.steps), slots, len(pool))
    return seconds, len(ahead), slots


def check(router: GenerationRouter, jobs: list[GenerationJob], now: float) -> None:
    """``DeadlineRefused`` when ``estimate`` is past the nearest deadline among ``jobs`` (counted in
    the router's ``deadline_refused``); its Retry-After: by how much."""
    timed = [j for j in jobs if j.deadline_at is not None]
    if not timed:
        return
    seconds, ahead, slots = estimate(router, jobs, now)
    first = min(timed, key=lambda j: j.deadline_at)
    left = first.deadline_at - now
    if seconds > left:
        router.counters.deadline_refused += 1
        raise DeadlineRefused(
            f"deadline_s={first.deadline_s:g} cannot be met: the estimate to finish is {seconds:.1f}s "
            f"({ahead} requests ahead on {slots} denoiser slots); retry later or with a longer deadline_s",
            retry_after=seconds - left,
        )
