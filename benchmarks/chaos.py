"""Chaos: under steady load, kill -9 each role of a 1:2:1 server in turn, then the head itself.

For each kill it records how the requests in flight ended (completed, or failed with which status
and message), how long until the killed worker was replaced (a new pid registered under its id),
and whether any zombie or orphan process is left. Killing the head must take every worker with it
(they watch their parent). Everything runs on 127.0.0.1; every process group started here is ended
by its pgid.

    python benchmarks/chaos.py --out benchmarks/reliability
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.soak import Server  # noqa: E402


def proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except OSError:
                pass
    return out


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
    args = ap.parse_args()
    from triptych.models import PACKAGED_DEFAULT

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(tempfile.mkdtemp(prefix="triptych-chaos-"))
    server = Server("chaos", str(PACKAGED_DEFAULT), 2, data)
    rows, ok = [], True
    try:
        server.wait_ready()
        load = Load(server.url)
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
            zombies = [c for c in children(server.proc.pid) if proc_state(c) == "Z"]
            rows.append({"kill": victim, "replaced_s": replaced, "zombies": zombies})
            ok &= replaced is not None and replaced < 30 and not zombies
        load.phase = "kill head"
        workers = children(server.proc.pid)
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(30)
        t0 = time.monotonic()
        while any(proc_state(p) not in (None, "Z") for p in workers) and time.monotonic() - t0 < 60:
            time.sleep(0.2)
        orphans = [p for p in workers if proc_state(p) not in (None, "Z")]
        rows.append({"kill": "head", "workers_gone_s": time.monotonic() - t0, "orphans": orphans})
        ok &= not orphans
        load.stop.set()
        for t in load.threads:
            t.join(150)
    finally:
        server.stop()
    result = {
        "rows": rows,
        "outcomes": {k: dict(v) for k, v in load.outcomes.items()},
        "errors": {k: sorted(v) for k, v in load.errors.items()},
        "pass": ok,
    }
    (out / "chaos.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
