"""Round 2 of "hard to break" (issue 24, items 1 and 3), against a real `triptych serve` on loopback.

(a) Long requests: a server with a short ``--body-read-timeout-s`` (5 s) answers the issue's request
    (512x512, 100 steps), which takes longer, with 200, streamed or not, where the head before this
    change answered 499 "client disconnected" at the body timeout.
(b) Large bodies: four chats at once, each two ~19.7 MiB noise PNG data URLs (~53 MiB of JSON,
    under the 64 MiB ``--max-json-bytes``), on the default heartbeat timeout (5 s): how many
    instances were lost, asked to rejoin or retried, how many heartbeats were read meanwhile, and the
    head's event loop lag (``triptych_head_event_loop_lag_max_seconds``, ``/metrics``).

The server runs the packaged default model (1:1:1; it generates and chats) in its own process group,
ended by its pgid. Writes a JSON of the figures.

    python benchmarks/long_and_large.py --out benchmarks/reliability
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.soak import free_port  # noqa: E402
from tests.e2e.test_http_large_bodies import chat_body, metric, noise_png  # noqa: E402
from triptych.families.models import PACKAGED_DEFAULT  # noqa: E402

BODY_TIMEOUT_S = 5.0


def start(data: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "triptych.cli", "serve", "--model", str(PACKAGED_DEFAULT), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--data-dir", str(data), "--body-read-timeout-s", str(BODY_TIMEOUT_S)]
    log = open(data.parent / "server.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 600
    while time.monotonic() < end:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"the server did not start; see {data.parent / 'server.log'}")


def stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def timed(fn) -> dict:
    t0 = time.perf_counter()
    try:
        r = fn()
        status, note = r.status_code, r.text[-120:] if r.status_code != 200 else ""
    except httpx.HTTPError as e:
        status, note = type(e).__name__, str(e)[:120]
    return {"status": status, "seconds": round(time.perf_counter() - t0, 1), "note": note}


def long_requests(url: str, steps: int) -> dict:
    image = {"prompt": "a red circle on a blue background", "size": "512x512", "num_inference_steps": steps}
    return {
        "image": timed(lambda: httpx.post(f"{url}/v1/images/generations", json=image, timeout=1200)),
        "image_stream": timed(
            lambda: httpx.post(f"{url}/v1/images/generations", json={**image, "stream": True}, timeout=1200)
        ),
    }


def large_bodies(url: str) -> dict:
    body = chat_body([noise_png(1), noise_png(2)])
    desc = httpx.get(f"{url}/health").json()["backend"]
    registered = {(i["id"], i["pid"]) for i in desc["instances"]}
    before = desc["stats"]
    headers = {"content-type": "application/json"}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        results = list(
            pool.map(
                lambda _: timed(
                    lambda: httpx.post(f"{url}/v1/chat/completions", content=body, headers=headers, timeout=1200)
                ),
                range(4),
            )
        )
    wall = time.perf_counter() - t0
    desc = httpx.get(f"{url}/health").json()["backend"]
    after = desc["stats"]
    text = httpx.get(f"{url}/metrics").text

    def delta(k: str) -> int:
        return after.get(k, 0) - before.get(k, 0)

    return {
        "body_mib": round(len(body) / 2**20, 1),
        "answers": results,
        "wall_s": round(wall, 1),
        "instances_before": len(registered),
        "same_processes_registered": {(i["id"], i["pid"]) for i in desc["instances"]} == registered,
        "instances_lost": delta("instances_lost"),
        "rejoins_requested": delta("rejoins_requested"),
        "chat_retries": delta("chat_retries"),
        "heartbeats_read": delta("heartbeats"),
        "head_stalls_excused": delta("head_stalls"),
        "loop_lag_max_s": round(metric(text, "triptych_head_event_loop_lag_max_seconds"), 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/reliability")
    ap.add_argument("--steps", type=int, default=100, help="denoising steps of the long image")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="triptych-round2-") as tmp:
        proc, url = start(Path(tmp) / "data")
        try:
            result = {"load_average_start": os.getloadavg(), "body_read_timeout_s": BODY_TIMEOUT_S}
            result["long_requests"] = long_requests(url, args.steps)
            result["large_bodies"] = large_bodies(url)
            result["load_average_end"] = os.getloadavg()
        finally:
            stop(proc)
    (out / "long_and_large.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
