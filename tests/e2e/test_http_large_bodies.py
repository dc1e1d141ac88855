"""Large legal bodies never stall the head (issue 24, item 3).

A chat with two ~20 MiB PNG data URLs (a 53 MiB body) used to hold the head's event loop for
seconds (the images were re-encoded as PNG for the wire on the loop): heartbeats went unread, every
worker was declared dead and re-registered, the chat was retried. Here a real head with its three
local workers (the packaged default edit model, which chats) takes four such bodies at once: every
chat is answered, no instance is lost or asked to rejoin, the same processes stay registered, and
heartbeats keep being counted throughout. The loop's lag is a Prometheus series; its maximum is
printed (a figure for ``benchmarks/RELIABILITY.md``, not asserted: it depends on the machine).
Fails on the head before this change (instances lost: heartbeat timeout 2 s here, 5 s by default).
"""

from __future__ import annotations

import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

from tests.e2e.http_support import serve
from triptych.families.models import PACKAGED_DEFAULT
from triptych.head.admission import AdmissionLimits
from triptych.head.app import HeadConfig, create_app

EDIT_MODEL = PACKAGED_DEFAULT.parent / "default_edit"
SIDE = 2624  # a noise PNG this size is 19.7 MiB: under max_upload_bytes (20 MiB), as large as it gets


def noise_png(seed: int, side: int = SIDE) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def chat_body(images: list[bytes]) -> bytes:
    parts = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(im).decode()}}
        for im in images
    ]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "What is in this image?"}]}]
    return json.dumps({"messages": messages, "max_tokens": 8, "seed": 1}).encode()


def metric(text: str, name: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[-1])


def test_four_53_mib_chat_bodies_lose_no_instance(tmp_path):
    from triptych.control.orchestrator import OrchestratorConfig
    from triptych.deploy.launch import EmbeddedBackend, TopologyConfig

    images = [noise_png(1), noise_png(2)]
    limits = AdmissionLimits()
    assert all(len(im) <= limits.max_upload_bytes for im in images)
    body = chat_body(images)
    config = HeadConfig(data_dir=tmp_path / "data", limits=limits)
    assert 50 * 2**20 < len(body) <= config.max_json_bytes  # ~53 MiB, under the 64 MiB limit

    backend = EmbeddedBackend(
        EDIT_MODEL,
        OrchestratorConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0),
        TopologyConfig(transfer="zmq", torch_threads=1),
    )
    with serve(create_app(backend, config)) as base:
        desc = httpx.get(f"{base}/health").json()["backend"]
        registered = {(i["id"], i["pid"]) for i in desc["instances"]}
        before = desc["stats"]

        def post(_):
            headers = {"content-type": "application/json"}
            return httpx.post(f"{base}/v1/chat/completions", content=body, headers=headers, timeout=600)

        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(post, range(4)))
        desc = httpx.get(f"{base}/health").json()["backend"]
        metrics = httpx.get(f"{base}/metrics").text

    assert [r.status_code for r in answers] == [200] * 4, [r.text[:300] for r in answers]
    assert all(r.json()["choices"][0]["message"]["content"] for r in answers)
    after = desc["stats"]
    assert {(i["id"], i["pid"]) for i in desc["instances"]} == registered  # same processes, none re-registered
    for event in ("instances_lost", "rejoins_requested", "chat_retries"):
        assert after.get(event, 0) == before.get(event, 0), (event, before, after)
    # Heartbeats kept being read: three workers send one each 0.2 s, and the four chats take seconds
    # (212 MiB to post, eight 20 MiB PNGs to decode and re-encode), so at least 3 per worker arrive.
    assert after["heartbeats"] - before.get("heartbeats", 0) >= 3 * len(registered), (before, after)
    lag_max = metric(metrics, "triptych_head_event_loop_lag_max_seconds")
    print(f"event loop lag max {lag_max:.3f}s; head stalls excused {after.get('head_stalls', 0)}")
