"""Chaos: under steady load, kill -9 each role of a 1:2:1 server in turn, then the head itself.

For each kill it records how the requests in flight ended (completed, or failed with which status
and message), how long until the killed worker was replaced (a new pid registered under its id),
and whether any zombie or orphan process is left. Every request of the worker kills must be
answered 200 (a request whose worker died is retried elsewhere, or waits for the replacement when
it had the only one: ``--denoisers 1`` makes every role single). The load stops, its requests
answered, before the head is killed; killing the head must take every worker with it
(the kernel's parent-death signal). Everything runs on 127.0.0.1; every process group started here
is ended by its pgid.

Before the load starts, a replay probe registers a fake encoder with the deployment's token (read
from the data directory), records its signed frames, and replays them from a second socket while it
lives and again after it is gone; the head's ``replays_refused`` count and whether a ghost appeared
are recorded. ``--cpu-hogs N`` runs N busy-loop processes beside everything (ended by pid), and each
row carries the 1-minute load average when it was measured.

    python benchmarks/chaos.py --out benchmarks/reliability [--cpu-hogs 2] [--denoisers 1 --clients 6]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.soak import Server  # noqa: E402
from triptych.control import protocol as P  # noqa: E402
from triptych.control.auth import ControlKey  # noqa: E402
from triptych.worker.control_client import ControlClient  # noqa: E402

HOG = "while True: pass"


def load1() -> float:
    return round(os.getloadavg()[0], 2)


def replay_probe(url: str, token: str, beats: int = 20) -> dict:
    """Register a fake encoder, record its frames, replay them from other sockets (see the module
    docstring); returns the counts. Run before any load, so no request is routed to the probe."""
    backend = httpx.get(f"{url}/health", timeout=10).json()["backend"]
    ctx = zmq.Context()

    def dealer(identity: bytes) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(backend["control"])
        return sock

    try:
        real = ControlClient(dealer(b"chaos-probe#control"), ControlKey(token))
        frames: list[list[bytes]] = []
        send = real.sender._send
        real.sender._send = lambda f: (frames.append([bytes(x) for x in f]), send(f))
        register = P.Register(
            instance_id="chaos-probe",
            role="encoder",
            capacity=1,
            control="chaos-probe",
            data="tcp://127.0.0.1:1",
            transfer="zmq",
            revision=backend["revision"],
            pid=os.getpid(),
        )
        assert real.register(register, 30.0, on_skipped=lambda m: None).accepted
        for _ in range(beats):
            real.send(P.Heartbeat(instance_id="chaos-probe", active=0, free_slots=1, max_slots=1, engine_running=0))
        before = backend["stats"].get("replays_refused", 0)
        rogue = dealer(b"chaos-rogue")
        for f in frames[1:]:  # the Register and the heartbeats
            rogue.send_multipart(f)
        real.sock.close(0)
        t0 = time.monotonic()  # the head declares the silent probe dead after its heartbeat timeout
        while time.monotonic() - t0 < 60:
            desc = httpx.get(f"{url}/health", timeout=10).json()["backend"]
            if "chaos-probe" not in {i["id"] for i in desc["instances"]}:
                break
            time.sleep(0.2)
        late = dealer(b"chaos-rogue-late")
        for f in frames[1:]:
            late.send_multipart(f)
        time.sleep(2.0)
        desc = httpx.get(f"{url}/health", timeout=10).json()["backend"]
        return {
            "replayed": 2 * (len(frames) - 1),
            "replays_refused": desc["stats"].get("replays_refused", 0) - before,
            "ghost_registered": "chaos-probe" in {i["id"] for i in desc["instances"]},
            "load1": load1(),
        }
    finally:
        ctx.destroy(linger=0)


def proc_state(pid: int) -> str | None:
    """``psutil``'s status of ``pid`` (``"zombie"``, ``"running"``, ``"sleeping"``...); None: gone."""
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return None


def children(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children()]
    except psutil.NoSuchProcess:
        return []


class Load:
    """Steady load: ``concurrency`` threads posting 2-step images; outcomes counted per phase."""

    def __init__(self, url: str, concurrency: int = 4):
        self.url, self.stop, self.phase = url, threading.Event(), "warm-up"
        self.outcomes: dict[str, Counter] = {}
        self.errors: dict[str, set] = {}
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(concurrency)]

    def run(self, i: int) -> None:
        n = 0
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                phase = self.phase
                body = {"prompt": f"a green square {i}-{n}", "size": "64x64", "num_inference_steps": 2, "seed": n}
                try:
                    r = client.post(f"{self.url}/v1/images/generations", json=body)
                    key = str(r.status_code)
                    if r.status_code != 200:
                        self.errors.setdefault(phase, set()).add(r.json()["error"]["message"][:160])
                except httpx.HTTPError as e:
                    key = type(e).__name__
                self.outcomes.setdefault(phase, Counter())[key] += 1
                n += 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/reliability")
    ap.add_argument("--settle-s", type=float, default=15.0)
    ap.add_argument("--cpu-hogs", type=int, default=0, help="busy-loop processes running beside everything")
    ap.add_argument("--denoisers", type=int, default=2, help="denoisers of the server (1: every role single)")
    ap.add_argument("--clients", type=int, default=4, help="clients posting images without pause")
    args = ap.parse_args()
    from triptych.families.models import PACKAGED_DEFAULT

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(tempfile.mkdtemp(prefix="triptych-chaos-"))
    server = Server("chaos", str(PACKAGED_DEFAULT), args.denoisers, data)
    rows, ok, probe, failed, head_stats = [], True, None, {}, {}
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.cpu_hogs)]
    try:
        server.wait_ready()
        probe = replay_probe(server.url, (data / "chaos" / "worker.token").read_text().strip())
        ok &= probe["replays_refused"] == probe["replayed"] and not probe["ghost_registered"]
        load = Load(server.url, args.clients)
        for t in load.threads:
            t.start()
        time.sleep(args.settle_s)
        for victim in ("encoder-0", "denoiser-0", "decoder-0"):
            health = httpx.get(f"{server.url}/health", timeout=10).json()
            (pid,) = [i["pid"] for i in health["backend"]["instances"] if i["id"] == victim]
            load.phase = f"kill {victim}"
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            replaced = None
            while time.monotonic() - t0 < 60:
                health = httpx.get(f"{server.url}/health", timeout=10).json()
                if any(i["id"] == victim and i["pid"] != pid for i in health["backend"]["instances"]):
                    replaced = time.monotonic() - t0
                    break
                time.sleep(0.2)
            time.sleep(args.settle_s)
            zombies = [c for c in children(server.proc.pid) if proc_state(c) == psutil.STATUS_ZOMBIE]
            rows.append({"kill": victim, "replaced_s": replaced, "zombies": zombies, "load1": load1()})
            ok &= replaced is not None and replaced < 30 and not zombies
        load.stop.set()  # every request of the worker kills answered before the head goes
        for t in load.threads:
            t.join(150)
        failed = {p: n for p, c in load.outcomes.items() if (n := sum(v for k, v in c.items() if k != "200"))}
        ok &= not failed
        head_stats = httpx.get(f"{server.url}/health", timeout=10).json()["backend"]["stats"]
        load.phase = "kill head"
        workers = children(server.proc.pid)
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(30)
        t0 = time.monotonic()
        while any(proc_state(p) not in (None, psutil.STATUS_ZOMBIE) for p in workers) and time.monotonic() - t0 < 60:
            time.sleep(0.2)
        orphans = [p for p in workers if proc_state(p) not in (None, psutil.STATUS_ZOMBIE)]
        gone_s = time.monotonic() - t0
        rows.append({"kill": "head", "workers_gone_s": gone_s, "orphans": orphans, "load1": load1()})
        ok &= not orphans
    finally:
        server.stop()
        for hog in hogs:
            hog.kill()
            hog.wait()
    result = {
        "cpu_hogs": args.cpu_hogs,
        "denoisers": args.denoisers,
        "clients": args.clients,
        "cpus": os.cpu_count(),
        "replay_probe": probe,
        "rows": rows,
        "outcomes": {k: dict(v) for k, v in load.outcomes.items()},
        "errors": {k: sorted(v) for k, v in load.errors.items()},
        "failed_answers": failed,  # per phase of the worker kills: answers other than 200
        "head_stats": head_stats,  # the head's event counters before it was killed (retries, waits...)
        "pass": ok,
    }
    (out / "chaos.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
