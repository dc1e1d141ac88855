"""The decoder's preview bookkeeping (``runners.decoder.DecoderRunner``) with a 10-line port and
family: previews and the final decode share one job; the final waits for the previews asked for
before it; a lost preview releases it; a cancel forgets everything."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from triptych.control import protocol as P
from triptych.control import wire
from triptych.families.base import Frames, GenerationParams
from triptych.worker.runners.decoder import DecoderRunner

WIRE = wire.params_to_wire(GenerationParams("x", height=16, width=16, frames=1, steps=4, seed=1))
SPEC = {"latents": P.TensorSpec("float32", (1, 1))}


class Port:
    instance_id = "dec-0"

    def __init__(self):
        self.jobs, self.sent, self.reserved = {}, [], []

    def adopt(self, job):
        self.jobs[job.request_id] = job

    def owns(self, job):
        return self.jobs.get(job.request_id) is job

    def finish(self, job):
        self.jobs.pop(job.request_id, None)

    def reserve(self, job, handoff, specs, source, timeout_s):
        self.reserved.append(handoff)

    def send(self, msg):
        self.sent.append(msg)

    def fail(self, job, error, retryable):
        raise AssertionError(f"failed: {error}")


class Family:
    def decode(self, latents, params):
        return Frames(np.full((1, 16, 16, 3), float(latents.item()), dtype=np.float32))


def preview_task(index):
    return P.PreviewTask(
        request_id="r1",
        generation=1,
        params=WIRE,
        index=index,
        step=index + 1,
        total=4,
        specs=SPEC,
        source="den-0",
        output_format="png",
        quality=None,
        reserve_timeout_s=30.0,
    )


DECODE = P.DecodeTask(
    request_id="r1",
    generation=1,
    params=WIRE,
    specs=SPEC,
    source="den-0",
    output_format="png",
    fps=16,
    reserve_timeout_s=30.0,
)


@pytest.fixture
def runner():
    return DecoderRunner(Family(), Port())


def drain(runner):
    while runner.has_work():
        runner.execute()
    return [type(m).__name__ + (f"{m.index}" if isinstance(m, P.PreviewResult) else "") for m in runner.port.sent]


def test_final_waits_for_earlier_previews_even_when_it_lands_first(runner):
    for task in (preview_task(0), preview_task(1), DECODE):
        runner.accept(task)
    assert runner.port.reserved == ["preview0", "preview1", "latents"]
    job = runner.port.jobs["r1"]
    runner.arrived(job, {"latents": torch.ones(1, 1)})
    runner.preview_arrived(job, "preview1", {"latents": torch.zeros(1, 1)})
    assert drain(runner) == ["PreviewResult1"]  # the final is held back for preview 0
    runner.preview_arrived(job, "preview0", {"latents": torch.zeros(1, 1)})
    assert drain(runner) == ["PreviewResult1", "PreviewResult0", "MediaResult"]
    assert "r1" not in runner.port.jobs


def test_a_lost_preview_releases_the_final(runner):
    for task in (preview_task(0), DECODE):
        runner.accept(task)
    job = runner.port.jobs["r1"]
    runner.arrived(job, {"latents": torch.ones(1, 1)})
    assert drain(runner) == []
    runner.preview_arrived(job, "preview0", None)  # its transfer failed
    assert drain(runner) == ["MediaResult"]


def test_abort_forgets_previews_and_a_new_generation_starts_clean(runner):
    runner.accept(preview_task(0))
    job = runner.port.jobs["r1"]
    runner.preview_arrived(job, "preview0", {"latents": torch.zeros(1, 1)})
    runner.port.jobs.pop("r1")
    runner.abort(job)
    assert not runner.has_work()
    retry = P.DecodeTask(
        request_id="r1",
        generation=2,
        params=WIRE,
        specs=SPEC,
        source="den-0",
        output_format="png",
        fps=16,
        reserve_timeout_s=30.0,
    )
    runner.accept(retry)
    runner.arrived(runner.port.jobs["r1"], {"latents": torch.ones(1, 1)})
    assert drain(runner) == ["MediaResult"]


def test_media_too_large_for_a_control_frame_fails_the_request_naming_the_limit(runner, monkeypatch):
    """The head drops a frame above its limit unread; the decoder says why instead of sending it."""
    monkeypatch.setattr(P, "MAX_MEDIA_BYTES", 64)  # a 16x16 PNG is larger
    failures = []
    runner.port.fail = lambda job, error, retryable: failures.append((str(error), retryable))
    runner.accept(DECODE)
    runner.arrived(runner.port.jobs["r1"], {"latents": torch.ones(1, 1)})
    assert drain(runner) == [] and len(failures) == 1
    message, retryable = failures[0]
    assert "above the 64 a result may carry" in message and retryable is False
