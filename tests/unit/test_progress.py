"""Job progress (``triptych.core.progress``): steps fill 90 points, the decode the rest; a video job's
record never goes back, even when a retried job steps again from 0; ``generate`` shows the same."""

from __future__ import annotations

import asyncio

from triptych.control.backend import GenerationBackend, GenerationJob
from triptych.core.progress import progress_percent
from triptych.head.admission import Admission, AdmissionLimits
from triptych.head.jobs import VideoJobs, VideoRecord


def test_steps_fill_ninety_points():
    assert [progress_percent(s, 4) for s in range(5)] == [0, 22, 45, 67, 90]
    assert progress_percent(0, 0) == 0 and progress_percent(7, 5) == 90


class ReplayBackend(GenerationBackend):
    """Reports ``steps`` as progress (a retry shows as a restart from 1) and records the job's
    stored progress after each report."""

    def __init__(self, steps, total, jobs_ref):
        self.family, self.steps, self.total, self.jobs_ref = None, steps, total, jobs_ref
        self.seen: list[int] = []

    async def run(self, job, on_progress=None, on_preview=None):
        for step in self.steps:
            on_progress(step, self.total)
            self.seen.append(self.jobs_ref[0].store.get(job.request_id).progress)
            await asyncio.sleep(0)
        return b"mp4"

    async def cancel(self, request_id):
        return False


def test_video_job_progress_is_monotonic_and_ends_at_100(tmp_path):
    ref: list = []
    backend = ReplayBackend([1, 2, 3, 1, 2, 3, 4], 4, ref)

    async def main():
        jobs = VideoJobs(tmp_path, ttl_s=None)
        ref.append(jobs)
        rec = VideoRecord("v1", 0, "queued", 0, "m", "p", "32x32", "1", 5)
        jobs.submit(rec, GenerationJob("v1", None, "mp4"), backend, Admission(AdmissionLimits()))
        while jobs._tasks:
            await asyncio.sleep(0.01)
        final = jobs.store.get("v1")
        await jobs.close()
        return final

    final = asyncio.run(main())
    assert backend.seen == [22, 45, 67, 67, 67, 67, 90]
    assert (final.status, final.progress) == ("completed", 100)
