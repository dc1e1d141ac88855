"""Video job routes: lifecycle through the ``openai`` client, cancel on DELETE, list, restart.

The head validates against the tiny Wan text-to-video family (weightless) when it is importable,
else a fake video family; a fake backend makes the bytes except in the one real end-to-end test.
"""

from __future__ import annotations

import base64
import importlib.util

import httpx
import openai
import pytest

from tests.e2e.http_support import FakeBackend, FakeFamily, png_bytes, serve, wait_for
from triptych.head.admission import AdmissionLimits
from triptych.head.app import HeadConfig, create_app
from triptych.head.jobs import JobStore, VideoRecord

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
HAVE_WAN = importlib.util.find_spec("triptych.families.wan.family") is not None


@pytest.fixture(scope="module")
def video_family(tiny_model_dir, tmp_path_factory):
    if HAVE_WAN:
        from triptych.families.registry import load_family

        return load_family(tiny_model_dir("wan-t2v"), roles=())
    return FakeFamily(tmp_path_factory.mktemp("fake-video"), is_video=True)


def start(family, data_dir, gated=False, **config):
    backend = FakeBackend(family, gated=gated)
    return backend, serve(create_app(backend, HeadConfig(data_dir=data_dir, **config)))


def client_for(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def wait_status(client, video_id, status):
    return wait_for(lambda: (v := client.videos.retrieve(video_id)).status == status and v, f"status {status}")


def jobs_ended(backend, outcome: str) -> float:
    return backend.metrics.registry.get_sample_value("triptych_video_jobs_total", {"outcome": outcome}) or 0.0


def test_lifecycle_create_poll_download_list_delete(video_family, tmp_path):
    backend, server = start(video_family, tmp_path / "data")
    with server as base:
        client = client_for(base)
        completed = jobs_ended(backend, "completed")
        video = client.videos.create(prompt="a boat", extra_body={"seed": 4, "frames": 5})
        assert video.status == "queued" and video.progress == 0 and video.id.startswith("video_")
        done = wait_status(client, video.id, "completed")
        wait_for(lambda: jobs_ended(backend, "completed") == completed + 1, "the job's outcome counted when it ended")
        assert done.progress == 100 and done.completed_at is not None
        mp4 = client.videos.download_content(video.id).read()
        assert mp4[4:8] == b"ftyp"
        assert [v.id for v in client.videos.list().data] == [video.id]
        assert client.videos.delete(video.id).deleted
        with pytest.raises(openai.NotFoundError):
            client.videos.retrieve(video.id)
        assert backend.jobs[0].output_format == "mp4" and backend.jobs[0].params.seed == 4


def test_delete_cancels_a_running_job(video_family, tmp_path):
    backend, server = start(video_family, tmp_path / "data", gated=True)
    with server as base:
        client = client_for(base)
        cancelled, completed = jobs_ended(backend, "cancelled"), jobs_ended(backend, "completed")
        video = client.videos.create(prompt="a boat")
        wait_for(lambda: video.id in backend.running, "job running")
        resp = httpx.get(f"{base}/v1/videos/{video.id}/content")
        assert resp.status_code == 409 and "status" in resp.json()["error"]["message"]
        client.videos.delete(video.id)
        assert video.id in backend.cancelled
        wait_for(lambda: httpx.get(f"{base}/health").json()["in_flight"] == 0, "slot released")
        assert (jobs_ended(backend, "cancelled"), jobs_ended(backend, "completed")) == (cancelled + 1, completed)
        assert client.videos.list().data == []


def test_seconds_map_to_a_frame_count_the_model_accepts(video_family, tmp_path):
    backend, server = start(video_family, tmp_path / "data", video_fps=8)
    with server as base:
        video = client_for(base).videos.create(prompt="x", seconds="1")  # 8 frames; Wan needs 4k+1 → 9
        assert video.model_extra["frames"] == 9 and video.seconds == "1.125"
        resp = httpx.post(f"{base}/v1/videos", json={"prompt": "x", "frames": 8})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "frames"
        resp = httpx.post(f"{base}/v1/videos", json={"prompt": "x", "seconds": 100000})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "seconds"


def test_restart_keeps_completed_and_fails_interrupted(video_family, tmp_path):
    data = tmp_path / "data"
    backend, server = start(video_family, data)
    with server as base:
        client = client_for(base)
        video = client.videos.create(prompt="kept", extra_body={"seed": 1})
        wait_status(client, video.id, "completed")
        mp4 = client.videos.download_content(video.id).read()
    store = JobStore(data / "jobs.sqlite")  # a job the dead head left running
    store.insert(
        VideoRecord(
            id="video_dead",
            created_at=0,
            status="in_progress",
            progress=40,
            model="m",
            prompt="lost",
            size="32x32",
            seconds="1",
            frames=17,
        )
    )
    store.close()
    backend2, server2 = start(video_family, data)
    with server2 as base:
        client = client_for(base)
        assert client.videos.retrieve(video.id).status == "completed"
        assert client.videos.download_content(video.id).read() == mp4
        dead = client.videos.retrieve("video_dead")
        assert dead.status == "failed" and dead.error.code == "interrupted"
        listed = client.videos.list(order="asc", limit=1)
        assert listed.has_more and listed.data[0].id == "video_dead"
        assert [v.id for v in client.videos.list(after="video_dead", order="asc").data] == [video.id]


def test_input_reference_upload_is_checked(video_family, tmp_path):
    limits = AdmissionLimits(max_upload_bytes=2048)
    backend, server = start(video_family, tmp_path / "data", limits=limits)
    with server as base:
        for payload, needle in [(b"garbage", "decodable"), (b"\0" * 4096, "bytes")]:
            resp = httpx.post(f"{base}/v1/videos", data={"prompt": "x"}, files={"input_reference": ("a.png", payload)})
            assert resp.status_code == 400 and needle in resp.json()["error"]["message"], resp.text
            assert resp.json()["error"]["param"] == "input_reference"
        # a valid image on a text-to-video model: refused by the family, naming the field
        data_url = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
        resp = httpx.post(f"{base}/v1/videos", json={"prompt": "x", "input_reference": {"image_url": data_url}})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "image"
        assert not backend.jobs


def test_video_queue_full_is_429(video_family, tmp_path):
    limits = AdmissionLimits(max_queued_requests=1, max_n=1)
    backend, server = start(video_family, tmp_path / "data", gated=True, limits=limits)
    with server as base:
        client = client_for(base)
        client.videos.create(prompt="a")
        with pytest.raises(openai.RateLimitError):
            client.videos.create(prompt="b")
        assert len(client.videos.list().data) == 1
        backend.open_gate()


@pytest.mark.skipif(not HAVE_WAN, reason="tiny Wan family not available")
def test_real_wan_video_end_to_end(tiny_model_dir, tmp_path):
    from triptych.control.backend import InProcessBackend
    from triptych.families.registry import load_family

    app = create_app(InProcessBackend(load_family(tiny_model_dir("wan-t2v"))), HeadConfig(data_dir=tmp_path / "data"))
    with serve(app) as base:
        client = client_for(base)
        video = client.videos.create(prompt="a boat", size="32x32", extra_body={"frames": 5, "num_inference_steps": 2})
        done = wait_for(lambda: (v := client.videos.retrieve(video.id)).status in ("completed", "failed") and v, "done")
        assert done.status == "completed", done.error
        assert client.videos.download_content(video.id).read()[4:8] == b"ftyp"


def test_shutdown_fails_running_jobs_as_interrupted(video_family, tmp_path):
    backend, server = start(video_family, tmp_path / "data", gated=True)
    with server as base:
        video = client_for(base).videos.create(prompt="x")
        wait_for(lambda: video.id in backend.running, "job running")
    assert video.id in backend.cancelled
    store = JobStore(tmp_path / "data" / "jobs.sqlite")
    assert (store.get(video.id).status, store.get(video.id).error_code) == ("failed", "interrupted")
    store.close()
