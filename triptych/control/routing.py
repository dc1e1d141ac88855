"""Generation routing on the head: each request through an encoder, a denoiser and a decoder.

Ownership contract:
- The router owns every generation's ``RequestMachine`` and every instance slot it charged
  (``Instance.held``). Workers own tensors and transfer slots; the head only ever sees specs and
  ``TensorRef`` handles (and the final media bytes).
- Backpressure: a request starts encoding only once an encoder *and* a denoiser slot are charged
  to it, and its denoise task is sent only once a decoder slot is charged, so no stage starts work
  whose output has nowhere to go. Each wait is its own queue (``wait_encode``, ``wait_decoder``) so
  a request waiting for a decoder never holds up one waiting for an encoder.
- A slot is freed when its tensors left the instance (``PushDone``), the request ended, or the
  instance died. Ending a request any other way than DONE also sends ``Cancel`` to every worker
  still holding something of it.
- A request whose instance died (or failed retryably) is retried under a new generation, away from
  that instance (``Attempts``); messages of an older generation are counted and dropped. With no
  other instance of that role registered the retry waits for one (``replacement``), bounded by
  ``replacement_wait_s`` and the job's deadline, holding nothing meanwhile.
- What survives a death: a stage's output once pushed on (``PushDone`` frees the sender's slot, so
  its death no longer touches the request). All else re-runs from the encode: the conditioning and
  the latents each live on one worker only, so a dead denoiser or decoder costs the whole request.
- Admission, cancel, expiry, retries and endings are the shared ``lifecycle.Lifecycle`` (the chat
  router composes the same one); this module adds placement and the stage messages.
All state lives on the head's event loop; nothing here takes a lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from triptych.control import protocol as P
from triptych.control import wire
from triptych.control.attempts import Attempts
from triptych.control.backend import GenerationJob, PreviewFn, ProgressFn, StageFailed
from triptych.control.counters import LifecycleCounters
from triptych.control.dispatch import Instance
from triptych.control.lifecycle import Lifecycle
from triptych.control.metrics import Metrics, StageStats
from triptych.control.registry import InstanceRegistry
from triptych.control.replacement import plan_retry
from triptych.control.request_state import TRANSITIONS, RequestMachine, RequestState, StateTimeouts
from triptych.control.step_costs import StepCosts, shape_of
from triptych.core.kinds import Role

logger = logging.getLogger(__name__)
S = RequestState


@dataclass
class Tracked:
    """One live generation on the head."""

    job: GenerationJob
    machine: RequestMachine
    future: asyncio.Future
    on_progress: ProgressFn | None
    wire: P.WireParams
    assigned: dict[str, str] = field(default_factory=dict)  # role -> instance id charged a slot
    cond_specs: dict[str, P.TensorSpec] | None = None
    attempts: Attempts = field(default_factory=Attempts)
    waited_s: float = 0.0  # queue wait of the current stage (reported with its run time at its end)
    encoded_at: float = 0.0  # monotonic time of EncodeDone: the wait for a decoder slot starts
    on_preview: PreviewFn | None = None  # set: the job's previews are decoded and handed here


class GenerationRouter:
    def __init__(
        self,
        *,
        registry: InstanceRegistry,
        send: Callable[[str, P.Message], None],
        metrics: Metrics,
        counters: LifecycleCounters,
        timeouts: StateTimeouts,
        max_retries: int,
        max_queued: int,
        reserve_timeout_s: float,
        replacement_wait_s: float,
        costs: StepCosts | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``costs``: the step costs deadlines are estimated with (learned from ``DenoiseDone``);
        ``clock``: the time the machines' entry times and stage reports read (a simulator's virtual
        clock; the head's is ``time.monotonic``)."""
        self.clock = clock
        self.registry = registry
        self.replacement_wait_s = replacement_wait_s
        self.send = send
        self.metrics = metrics
        self.counters = counters
        self.reserve_timeout_s = reserve_timeout_s
        self.lifecycle: Lifecycle[Tracked] = Lifecycle(
            kind="request",
            table=TRANSITIONS,
            timeouts=timeouts,
            max_retries=max_retries,
            max_queued=max_queued,
            counters=counters,
            release=self._release,
            waiting=frozenset({S.QUEUED, S.ENCODING}),  # a missed deadline drops it until it denoises
        )
        self.costs = costs or StepCosts()
        self.requests = self.lifecycle.requests
        self.wait_encode = self.lifecycle.queue  # waiting for an encoder and a denoiser slot
        self.wait_decoder: deque[str] = deque()  # encoded, waiting for a decoder slot
        self._handlers = {
            P.EncodeDone: self._on_encode_done,
            P.SlotsReserved: self._on_slots_reserved,
            P.PushDone: self._on_push_done,
            P.PreviewReady: self._on_preview_ready,
            P.PreviewResult: self._on_preview_result,
            P.DenoiseDone: self._on_denoise_done,
            P.MediaResult: self._on_media,
            P.StageError: self._on_stage_error,
        }

    def submit(
        self,
        job: GenerationJob,
        on_progress: ProgressFn | None,
        on_preview: PreviewFn | None = None,
        wire_params: P.WireParams | None = None,
    ) -> asyncio.Future:
        """``wire_params``: ``wire.params_to_wire(job.params)`` made already (off the event loop: its
        condition image's PNG encode takes seconds for a large one); None = made here."""
        if wire_params is None:
            wire_params = wire.params_to_wire(job.params)
        future = asyncio.get_running_loop().create_future()
        machine = self.lifecycle.machine(job.request_id)
        tracked = Tracked(job, machine, future, on_progress, wire_params, on_preview=on_preview)
        p = job.params
        self.lifecycle.admit(tracked, p.priority, p.tenant, job.weight)
        return future

    def cancel(self, request_id: str) -> bool:
        return self.lifecycle.cancel(request_id)

    def end_all(self, error: Callable[[str], Exception]) -> None:
        self.lifecycle.end_all(error)

    def fail_queued(self, error: Exception) -> None:
        """End every request still waiting for its encode with ``error`` (a role it needs is gone),
        but for retries waiting for a replacement: their wait has its own bound."""
        self.lifecycle.fail_queued(error, spare=lambda tr: tr.attempts.waiting is not None)

    def expire(self, now: float) -> None:
        """End the requests past a state's timeout, and the retries whose replacement wait ran out."""
        for tr in [t for t in self.requests.values() if t.attempts.waiting and now >= t.attempts.waiting.until]:
            self.counters.replacement_waits_expired += 1
            self.lifecycle.finish(tr, S.FAILED, error=StageFailed(tr.attempts.waiting.error()))
        self.lifecycle.expire(now)

    def handle(self, msg) -> None:
        tr = self.requests.get(msg.request_id)
        if tr is None and isinstance(msg, P.MediaResult):
            self.counters.done_after_end += 1
            return
        if tr is None or tr.machine.generation != msg.generation:
            # NOTE: a PushDone racing the MediaResult of a finished request lands here too.
            if tr is None:
                self.counters.dropped_after_end += 1
            else:
                self.counters.dropped_stale += 1
            logger.debug("dropped stale %s for %s g%d", type(msg).__name__, msg.request_id, msg.generation)
            return
        self._handlers[type(msg)](tr, msg)

    def on_tick(self, report: P.TickReport) -> None:
        """A denoiser's tick: each followed request's steps to its ``on_progress``."""
        for p in report.progress:
            tr = self.requests.get(p.request_id)
            if tr is None:
                self.counters.dropped_after_end += 1
            elif tr.machine.generation != p.generation:
                self.counters.dropped_stale += 1
            elif tr.on_progress is not None and self._from(tr, Role.DENOISER, report):
                tr.on_progress(p.step, p.total)

    def instance_lost(self, instance_id: str, why: str) -> None:
        for tr in [t for t in self.requests.values() if instance_id in t.assigned.values()]:
            self._retry(tr, why, exclude=instance_id)

    def describe(self) -> dict:
        return {
            "requests": dict(Counter(t.machine.state.value for t in self.requests.values())),
            "queues": {"encode": len(self.wait_encode), "decoder": len(self.wait_decoder)},
            "tenants": dict(self.wait_encode.served),
        }

    def backlog(self, now: float) -> dict[str, tuple[int, float]]:
        """Per queue, the requests waiting and how long the first has waited: ``encode`` (waiting for
        an encoder and a denoiser slot) and ``decoder`` (encoded, waiting for a decoder slot)."""
        first_dec = min((self.requests[rid].encoded_at for rid in self.wait_decoder), default=now)
        return {"encode": self.lifecycle.backlog(now), "decoder": (len(self.wait_decoder), now - first_dec)}

    # ---- placement ----------------------------------------------------------------------------
    def pump(self) -> None:
        """Start whatever the free slots allow: encodes (encoder + denoiser slot), then denoises
        (decoder slot)."""
        while self.wait_encode:
            placed = self._place_encode()
            if placed is None:
                break
            tr, enc, den = placed
            self._charge(tr, enc)
            self.registry.affinity.record(tr.attempts.image_keys or [], enc.instance_id)
            self._charge(tr, den)
            now = self.clock()
            tr.waited_s = now - tr.machine.entered_at
            tr.machine.to(S.ENCODING, now)
            keys = tr.attempts.image_keys or []
            hints = self.registry.affinity.hints(keys, enc.instance_id, self.registry.addresses(Role.ENCODER))
            task = P.EncodeTask(
                request_id=tr.job.request_id,
                generation=tr.machine.generation,
                params=tr.wire,
                denoiser=den.instance_id,
                mm_hints=hints,
            )
            self.send(enc.instance_id, task)
        while self.wait_decoder:
            rid = min(self.wait_decoder, key=self.wait_encode.key)  # its queue key: priority, share, arrival
            tr = self.requests[rid]
            dec = self._pick(Role.DECODER, tr)
            if dec is None:
                break
            self.wait_decoder.remove(rid)
            self._charge(tr, dec)
            now = self.clock()
            tr.waited_s = now - tr.encoded_at
            tr.machine.to(S.DENOISING, now)
            task = P.DenoiseTask(
                request_id=tr.job.request_id,
                generation=tr.machine.generation,
                params=tr.wire,
                specs=tr.cond_specs,
                source=tr.assigned[Role.ENCODER],
                decoder=dec.instance_id,
                reserve_timeout_s=self.reserve_timeout_s,
                previews=tr.job.partial_images if tr.on_preview is not None else 0,
                progress=tr.on_progress is not None,
            )
            self.send(tr.assigned[Role.DENOISER], task)

    def _place_encode(self) -> tuple[Tracked, Instance, Instance] | None:
        """The first waiting request (in queue order: ``fair_queue``) that an encoder and a denoiser
        slot can take now.

        A retried request may avoid instances that failed it, so it can wait while one behind it
        starts; the first request with nothing to avoid that cannot start ends the search (every
        later one would fail the same way), so order holds among ordinary requests."""
        for rid in self.wait_encode:
            tr = self.requests[rid]
            enc = self._pick(Role.ENCODER, tr)
            den = enc and self._pick(Role.DENOISER, tr)
            if enc is not None and den is not None:
                self.wait_encode.take(rid)
                return tr, enc, den
            if not tr.attempts.avoid:
                return None
        return None

    def _pick(self, role: str, tr: Tracked) -> Instance | None:
        affinity = None
        if role == Role.ENCODER:  # prefer the encoder that holds the condition image (``affinity``)
            affinity = self.registry.affinity
            if tr.attempts.image_keys is None:
                tr.attempts.image_keys = affinity.keys(tr.job.params.tenant, [tr.job.params.image])
        loras = [name for name, _ in tr.job.params.lora] if role == Role.DENOISER else ()  # ``lora_affinity``
        return tr.attempts.pick(self.registry.policies[role], role, self.registry.pool(role), affinity, loras=loras)

    def _charge(self, tr: Tracked, inst: Instance) -> None:
        inst.hold(tr.job.request_id)
        tr.assigned[inst.role] = inst.instance_id
        if tr.attempts.waiting is not None and tr.attempts.waiting.role == inst.role:
            tr.attempts.waiting = None  # the role it waited for took it

    def _uncharge(self, tr: Tracked, role: str) -> None:
        iid = tr.assigned.pop(role, None)
        inst = self.registry.instances.get(iid) if iid is not None else None
        if inst is not None:
            inst.unhold(tr.job.request_id)

    # ---- messages -----------------------------------------------------------------------------
    def _from(self, tr: Tracked, role: str, m) -> bool:
        if tr.assigned.get(role) == m.instance_id:
            return True
        self.counters.dropped_misrouted += 1
        logger.debug(
            "%s for %s from %s, expected %s %s",
            type(m).__name__,
            tr.job.request_id,
            m.instance_id,
            role,
            tr.assigned.get(role),
        )
        return False

    def _on_encode_done(self, tr: Tracked, m: P.EncodeDone) -> None:
        if self._from(tr, Role.ENCODER, m) and tr.machine.state is S.ENCODING and tr.cond_specs is None:
            tr.cond_specs = m.specs
            self.registry.affinity.held(tr.attempts.image_keys or [], m.instance_id, m.images)
            tr.encoded_at = self._stage_done(tr, "encode")
            self.wait_decoder.append(tr.job.request_id)

    def _on_slots_reserved(self, tr: Tracked, m: P.SlotsReserved) -> None:
        receiver, sender = (Role.DENOISER, Role.ENCODER) if m.handoff == "cond" else (Role.DECODER, Role.DENOISER)
        if self._from(tr, receiver, m) and sender in tr.assigned:
            self.send(
                tr.assigned[sender],
                P.PushTask(request_id=m.request_id, generation=m.generation, handoff=m.handoff, refs=m.refs),
            )

    def _on_push_done(self, tr: Tracked, m: P.PushDone) -> None:
        if m.handoff in P.PREVIEW_HANDOFFS:
            return  # a preview's push frees nothing the head charged
        sender = Role.ENCODER if m.handoff == "cond" else Role.DENOISER
        if self._from(tr, sender, m):
            self._uncharge(tr, sender)

    def _on_preview_ready(self, tr: Tracked, m: P.PreviewReady) -> None:
        """Send the preview to the request's decoder; without a listener, the denoiser's copy is
        freed when the request leaves it."""
        if tr.on_preview is None or Role.DECODER not in tr.assigned or tr.machine.state is not S.DENOISING:
            return
        if self._from(tr, Role.DENOISER, m) and 0 <= m.index < len(P.PREVIEW_HANDOFFS):
            job = tr.job
            task = P.PreviewTask(
                request_id=job.request_id,
                generation=m.generation,
                params=tr.wire,
                index=m.index,
                step=m.step,
                total=m.total,
                specs=m.specs,
                source=m.instance_id,
                output_format=job.output_format,
                quality=job.quality,
                reserve_timeout_s=self.reserve_timeout_s,
            )
            self.send(tr.assigned[Role.DECODER], task)

    def _on_preview_result(self, tr: Tracked, m: P.PreviewResult) -> None:
        if tr.on_preview is not None and self._from(tr, Role.DECODER, m):
            tr.on_preview(m.index, m.data)

    def _on_denoise_done(self, tr: Tracked, m: P.DenoiseDone) -> None:
        if self._from(tr, Role.DENOISER, m) and tr.machine.state is S.DENOISING:
            self.costs.learn(shape_of(tr.job.params), m.tick_s, m.occupancy)
            tr.waited_s = 0.0  # the decoder slot was charged before denoising started
            tr.machine.to(S.DECODING, self._stage_done(tr, "denoise"))
            job = tr.job
            task = P.DecodeTask(
                request_id=job.request_id,
                generation=m.generation,
                params=tr.wire,
                specs=m.specs,
                source=m.instance_id,
                output_format=job.output_format,
                fps=job.fps,
                reserve_timeout_s=self.reserve_timeout_s,
                quality=job.quality,
            )
            self.send(tr.assigned[Role.DECODER], task)

    def _on_media(self, tr: Tracked, m: P.MediaResult) -> None:
        if self._from(tr, Role.DECODER, m) and tr.machine.state is S.DECODING:
            self._stage_done(tr, "decode")
            self.lifecycle.finish(tr, S.DONE, result=m.data)

    def _stage_done(self, tr: Tracked, stage: str) -> float:
        """Report the stage that just ended (its queue wait and its run time); returns now."""
        now = self.clock()
        self.metrics.record_stage(StageStats(stage, tr.waited_s, now - tr.machine.entered_at))
        return now

    def _on_stage_error(self, tr: Tracked, m: P.StageError) -> None:
        if m.instance_id not in tr.assigned.values():
            return
        what = f"{m.stage} failed on {m.instance_id}: {m.message}"
        if m.retryable:
            self._retry(tr, what, exclude=m.instance_id)
        else:
            self.lifecycle.finish(tr, S.FAILED, error=StageFailed(what))

    # ---- endings and retries ------------------------------------------------------------------
    def _release(self, tr: Tracked, cancel_reason: str | None) -> None:
        """The lifecycle's release: out of the decoder queue, every slot freed (``Cancel`` sent to
        each holder with a reason)."""
        rid = tr.job.request_id
        if rid in self.wait_decoder:
            self.wait_decoder.remove(rid)
        for role, iid in list(tr.assigned.items()):
            if cancel_reason is not None:
                self.send(iid, P.Cancel(request_id=rid, generation=tr.machine.generation, reason=cancel_reason))
            self._uncharge(tr, role)
        tr.cond_specs = None

    def _retry(self, tr: Tracked, why: str, exclude: str | None = None) -> None:
        """Back to the queue, away from ``exclude``; with no other instance of its role, waiting for one
        to register if ``exclude`` died (``replacement.plan_retry``)."""
        role = next((r for r, i in tr.assigned.items() if i == exclude), None)
        refusal, wait = tr.attempts.refusal(self.lifecycle.max_retries), None
        if refusal is None and role is not None:
            now, wait_s = self.clock(), self.replacement_wait_s
            refusal, wait = plan_retry(role, exclude, self.registry.instances, why, now, wait_s, tr.job.deadline)
        if wait is not None:
            tr.attempts.waiting = wait
            self.counters.replacement_waits += 1
        self.lifecycle.retry(tr, why, refusal, role, exclude)
