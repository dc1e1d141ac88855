"""Asynchronous video jobs: records persisted in SQLite, outputs as files under the data dir.

``JobStore`` owns the records (``<data_dir>/jobs.sqlite``, stdlib ``sqlite3``); ``VideoJobs`` owns the
asyncio task of each live job and its output file (``<data_dir>/videos/<id>.mp4``). A job is
``queued`` → ``in_progress`` (first progress report) → ``completed`` | ``failed`` | ``cancelled``;
``progress`` is ``triptych.core.progress``: steps done / total x 90 while denoising, 90 while decoding,
100 when completed, and never goes back (a retried job is not shown restarting).
Records survive restarts: opening a store marks jobs that were queued or running when the previous
head died as ``failed`` (their tasks died with it). Completed jobs are served until ``expires_at``;
``sweep`` removes expired records and files. Deleting a job cancels it in the backend and removes
its record and file; a task that finishes after its record was deleted discards its output.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from triptych.control.backend import (
    Cancelled,
    DeadlineMissed,
    GenerationBackend,
    GenerationJob,
    Overloaded,
    StageFailed,
)
from triptych.core.errors import InvalidParam
from triptych.core.private import private_dir, private_file, write_private
from triptych.core.progress import DONE, progress_percent
from triptych.head.admission import Admission

logger = logging.getLogger(__name__)

ACTIVE = ("queued", "in_progress")
STATUSES = ACTIVE + ("completed", "failed", "cancelled")


@dataclass
class VideoRecord:
    """One video job as stored and as shown by ``GET /v1/videos/{id}``."""

    id: str
    created_at: int  # unix seconds
    status: str  # one of STATUSES
    progress: int  # 0..100
    model: str
    prompt: str
    size: str  # "WxH" after the model's defaults were applied
    seconds: str  # frames / fps, as a string (OpenAI's type)
    frames: int
    completed_at: int | None = None
    expires_at: int | None = None
    error_code: str | None = None
    error_message: str | None = None


_COLUMNS = tuple(VideoRecord.__dataclass_fields__)
_SCHEMA = """CREATE TABLE IF NOT EXISTS videos (
    id TEXT PRIMARY KEY, created_at INTEGER NOT NULL, status TEXT NOT NULL, progress INTEGER NOT NULL,
    model TEXT NOT NULL, prompt TEXT NOT NULL, size TEXT NOT NULL, seconds TEXT NOT NULL,
    frames INTEGER NOT NULL, completed_at INTEGER, expires_at INTEGER, error_code TEXT, error_message TEXT)"""


class JobStore:
    """SQLite-backed video records. Thread-safe: one connection behind a lock (progress callbacks
    may arrive from a backend's worker thread)."""

    def __init__(self, path: Path):
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(private_file(path)), check_same_thread=False, isolation_level=None)
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(_SCHEMA)
            self._db.execute("CREATE INDEX IF NOT EXISTS videos_created ON videos(created_at, id)")

    def fail_interrupted(self) -> int:
        """Mark jobs left active by a previous head as failed; returns how many."""
        with self._lock:
            cur = self._db.execute(
                "UPDATE videos SET status='failed', error_code='interrupted', "
                "error_message='the server restarted while this job was running' "
                f"WHERE status IN ({','.join('?' * len(ACTIVE))})",
                ACTIVE,
            )
        return cur.rowcount

    def insert(self, rec: VideoRecord) -> None:
        with self._lock:
            self._db.execute(
                f"INSERT INTO videos ({','.join(_COLUMNS)}) VALUES ({','.join('?' * len(_COLUMNS))})",
                tuple(asdict(rec).values()),
            )

    def update(self, job_id: str, **changes) -> bool:
        """Set columns of one record; False if it no longer exists (deleted)."""
        assert changes and set(changes) <= set(_COLUMNS), changes
        cols = ", ".join(f"{k}=?" for k in changes)
        with self._lock:
            cur = self._db.execute(f"UPDATE videos SET {cols} WHERE id=?", (*changes.values(), job_id))
        return cur.rowcount == 1

    def get(self, job_id: str) -> VideoRecord | None:
        with self._lock:
            row = self._db.execute(f"SELECT {','.join(_COLUMNS)} FROM videos WHERE id=?", (job_id,)).fetchone()
        return VideoRecord(*row) if row else None

    def list(self, limit: int = 20, after: str | None = None, order: str = "desc") -> list[VideoRecord]:
        """Records ordered by (created_at, id); ``after`` is the last id of the previous page."""
        assert order in ("asc", "desc")
        cmp = "<" if order == "desc" else ">"
        sql = f"SELECT {','.join(_COLUMNS)} FROM videos"
        args: tuple = ()
        if after is not None:
            anchor = self.get(after)
            if anchor is None:
                raise InvalidParam("after", after, "no video with this id")
            sql += f" WHERE (created_at, id) {cmp} (?, ?)"
            args = (anchor.created_at, anchor.id)
        sql += f" ORDER BY created_at {order}, id {order} LIMIT ?"
        with self._lock:
            rows = self._db.execute(sql, (*args, limit)).fetchall()
        return [VideoRecord(*r) for r in rows]

    def delete(self, job_id: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM videos WHERE id=?", (job_id,)).rowcount == 1

    def expired(self, now: float) -> list[str]:
        with self._lock:
            rows = self._db.execute(
                "SELECT id FROM videos WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,)
            ).fetchall()
        return [r[0] for r in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()


class VideoJobs:
    """Runs video jobs on their model's backend and keeps their records and files (one store for every
    model the head serves).

    Each submitted job holds one slot of its model's ``Admission`` from ``submit`` until its task ends.
    """

    def __init__(self, data_dir: Path, ttl_s: float | None):
        self.dir = private_dir(Path(data_dir) / "videos")
        self.store = JobStore(Path(data_dir) / "jobs.sqlite")
        interrupted = self.store.fail_interrupted()
        if interrupted:
            logger.warning("marked %d video jobs failed: they were running when the head stopped", interrupted)
        self.ttl_s = ttl_s
        self._tasks: dict[str, tuple[asyncio.Task, GenerationBackend]] = {}
        self._closing = False

    def path(self, job_id: str) -> Path:
        return self.dir / f"{job_id}.mp4"

    def submit(
        self,
        rec: VideoRecord,
        job: GenerationJob,
        backend: GenerationBackend,
        admission: Admission,
        on_result: Callable[[bytes], None] | None = None,
    ) -> None:
        """Persist ``rec`` and start ``job`` on ``backend``; raises ``Overloaded`` (``admission`` is
        full) before persisting anything. ``on_result`` gets the MP4 once the job completed."""
        admission.reserve(1)
        try:
            self.store.insert(rec)
        except BaseException:
            admission.release(1)
            raise
        task = asyncio.create_task(self._run(rec.id, job, backend, admission, on_result), name=f"video-{rec.id}")
        self._tasks[rec.id] = (task, backend)

    async def complete(self, rec: VideoRecord, data: bytes, backend: GenerationBackend) -> None:
        """Persist ``rec`` as a job already completed with ``data`` as its MP4 (a result-cache hit):
        it holds no admission slot and runs nothing. ``rec`` is updated to what was stored."""
        await asyncio.to_thread(self._write, rec.id, data)
        rec.completed_at = int(time.time())
        rec.expires_at = rec.completed_at + int(self.ttl_s) if self.ttl_s else None
        rec.status, rec.progress = "completed", DONE
        self.store.insert(rec)
        backend.metrics.record_video_job("completed")

    async def _run(
        self,
        job_id: str,
        job: GenerationJob,
        backend: GenerationBackend,
        admission: Admission,
        on_result: Callable[[bytes], None] | None = None,
    ) -> None:
        last = [-1]

        def on_progress(done: int, total: int) -> None:
            # NOTE: a retried job steps again from 0; its record never goes back
            pct = progress_percent(done, total)
            if pct > last[0]:
                last[0] = pct
                self.store.update(job_id, status="in_progress", progress=pct)

        t0 = time.time()
        outcome = "failed"
        try:
            data = await backend.run(job, on_progress)
            await asyncio.to_thread(self._write, job_id, data)
            now = int(time.time())
            expires = now + int(self.ttl_s) if self.ttl_s else None
            if not self.store.update(job_id, status="completed", progress=DONE, completed_at=now, expires_at=expires):
                self.path(job_id).unlink(missing_ok=True)  # deleted while running
                outcome = "cancelled"
            else:
                outcome = "completed"
                if on_result is not None:
                    on_result(data)
                logger.info("video %s completed in %.1f s", job_id, time.time() - t0)
        except Cancelled:
            if self._closing:
                outcome = "interrupted"
                self._fail(job_id, "interrupted", "the server shut down")
            else:
                outcome = "cancelled"
                self.store.update(job_id, status="cancelled", error_code="cancelled", error_message="cancelled")
        except (InvalidParam, StageFailed, Overloaded, DeadlineMissed) as e:
            codes = {InvalidParam: "invalid_request", StageFailed: "stage_failed", DeadlineMissed: "deadline_missed"}
            self._fail(job_id, codes.get(type(e), "overloaded"), str(e))
        except asyncio.CancelledError:
            outcome = "interrupted"
            self._fail(job_id, "interrupted", "the server shut down")
            raise
        except Exception as e:  # noqa: BLE001 - a backend bug must fail this job, not the head
            logger.exception("video job %s failed", job_id)
            self._fail(job_id, "internal_error", type(e).__name__)
        finally:
            self._tasks.pop(job_id, None)
            admission.release(1)
            backend.metrics.record_video_job(outcome, time.time() - t0 if outcome == "completed" else None)

    def _fail(self, job_id: str, code: str, message: str) -> None:
        self.store.update(job_id, status="failed", error_code=code, error_message=message)

    def _write(self, job_id: str, data: bytes) -> None:
        tmp = self.dir / f".{job_id}.tmp"
        write_private(tmp, data)
        os.replace(tmp, self.path(job_id))

    async def delete(self, job_id: str) -> bool:
        """Cancel (if live) and remove record and file; False if the job does not exist."""
        if job_id in self._tasks:
            await self._tasks[job_id][1].cancel(job_id)
        existed = self.store.delete(job_id)
        if existed:
            self.path(job_id).unlink(missing_ok=True)
        return existed

    def sweep(self, now: float | None = None) -> int:
        """Remove expired jobs' records and files; returns how many."""
        ids = self.store.expired(time.time() if now is None else now)
        for job_id in ids:
            self.store.delete(job_id)
            self.path(job_id).unlink(missing_ok=True)
        return len(ids)

    async def close(self, grace_s: float = 10.0) -> None:
        """Stop live jobs (their records become ``failed``/``interrupted``) and close the store.

        Jobs get ``grace_s`` to honour ``backend.cancel`` before their tasks are cancelled outright.
        """
        self._closing = True
        tasks = list(self._tasks.items())
        for job_id, (_, backend) in tasks:
            await backend.cancel(job_id)
        if tasks:
            _, stuck = await asyncio.wait([t for _, (t, _) in tasks], timeout=grace_s)
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
        self.store.close()
