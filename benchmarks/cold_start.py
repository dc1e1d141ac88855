"""Cold start: a fresh ``triptych generate`` to its image and exit, a fresh ``triptych serve`` to ready
(issue 27 item 6), this tree against a peer tree, same run.

The peer is another checkout of the project (the tree before a change:
``git worktree add ../cold-base <sha>``); each command runs as a subprocess with ``PYTHONPATH`` set to
its tree and its tree as the working directory, on the same interpreter. Each round runs the peer,
then this tree; round 0 is a warm-up (not counted: it fills the OS page cache with both trees' and
the venv's files), then ``--repeats`` rounds. Measured, wall clock from ``Popen``:

- ``generate``: the default model's image (64x64, 20 steps), until its ``wrote`` line (printed after
  the file is closed) and until the process exits; the two trees' images are compared byte for byte;
- ``serve``: one model (the tree's packaged default) with one encoder, denoiser and decoder on
  127.0.0.1 (a free port, its own ``--data-dir``), until ``GET /health`` answers 200 with status
  ``ok``; then its process group gets SIGTERM (time to stop: until every process of the group is
  gone, so the next command does not share the CPUs with this one's exit).

Then one ``python -X importtime`` generate per tree: the top-level imports by cumulative time.

``--compile``: both commands with ``--compile`` and ``--compile-cache-dir`` a directory per tree, kept
across the rounds: the warm-up round compiles cold (its times are printed), the timed rounds are
restarts on a warm inductor cache, as a restarted worker sees it (dynamo still traces every graph;
a denoiser warms up before it registers, so ``serve``'s ready includes its warm-up).

    nice -n 10 python benchmarks/cold_start.py --peer ../cold-base [--repeats 3] [--out cold.md]
    nice -n 10 python benchmarks/cold_start.py --peer ../cold-base --compile [--no-imports]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parents[1]
PROMPT = "a red circle on a blue background"


def env_for(tree: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}


def generate(tree: Path, out: Path, importtime: bool = False, extra: tuple[str, ...] = ()) -> dict:
    """One cold ``triptych generate``: seconds to its ``wrote`` line and to its exit."""
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "triptych.cli", "generate"]
    cmd += ["--prompt", PROMPT, "--out", str(out), *extra]
    err = out.with_suffix(".stderr")
    t0 = time.perf_counter()
    with open(err, "wb") as stderr:
        proc = subprocess.Popen(cmd, cwd=tree, env=env_for(tree), stdout=subprocess.PIPE, stderr=stderr, text=True)
        wrote = None
        for line in proc.stdout:
            if line.startswith("wrote ") and wrote is None:
                wrote = time.perf_counter() - t0
        code = proc.wait()
    if code != 0 or wrote is None:
        raise SystemExit(f"generate in {tree} failed ({code}): {err.read_text()[-2000:]}")
    return {"image": wrote, "exit": time.perf_counter() - t0, "stderr": err}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(tree: Path, data_dir: Path, timeout_s: float = 600.0, extra: tuple[str, ...] = ()) -> dict:
    """One cold ``triptych serve`` (one model, one worker per role): seconds to ``/health`` ok, and
    from SIGTERM to the process group's exit."""
    port = free_port()
    model = tree / "triptych" / "assets" / "default"
    cmd = [sys.executable, "-m", "triptych.cli", "serve", "--model", str(model), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--data-dir", str(data_dir), "--encoders", "1", "--denoisers", "1", "--decoders", "1"]
    cmd += extra
    log = data_dir / "serve.log"
    data_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=tree, env=env_for(tree), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"serve in {tree} exited {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                if r.status_code == 200 and r.json().get("status") == "ok":
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > timeout_s:
                raise SystemExit(f"serve in {tree} not ready in {timeout_s} s: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        ready = time.perf_counter() - t0
    finally:
        t1 = time.perf_counter()
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
            group_gone(proc.pid, timeout_s=60)
        except (subprocess.TimeoutExpired, TimeoutError):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        stop = time.perf_counter() - t1
    return {"ready": ready, "stop": stop}


def group_gone(pgid: int, timeout_s: float) -> None:
    """Wait until no process of group ``pgid`` is left (the workers exit after the head): the next
    command must not share the CPUs with a previous one's exit."""
    deadline = time.perf_counter() + timeout_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        if time.perf_counter() > deadline:
            raise TimeoutError(f"process group {pgid} still alive after {timeout_s} s")
        time.sleep(0.01)


def top_imports(stderr: Path, n: int) -> list[tuple[str, float]]:
    """``-X importtime`` lines → the top-level imports (and their first level) by cumulative ms."""
    rows = []
    for line in stderr.read_text().splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \|( *)(\S+)", line)
        if m and len(m[2]) <= 3:  # depth 0 and 1
            rows.append((("  " if len(m[2]) > 1 else "") + m[3], int(m[1]) / 1000))
    return sorted(rows, key=lambda r: -r[1])[:n]


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer", required=True, type=Path, help="the other tree (e.g. a git worktree at the base commit)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=12, help="imports listed per tree")
    ap.add_argument("--out", type=Path, help="also write the markdown here")
    ap.add_argument("--compile", action="store_true", help="both commands with --compile (see the module doc)")
    ap.add_argument("--no-imports", action="store_true", help="leave out the -X importtime breakdown")
    args = ap.parse_args()
    trees = {"peer": args.peer.resolve(), "this": HERE}
    tmp = Path(tempfile.mkdtemp(prefix="cold_start_"))
    extra = {
        name: ("--compile", "--compile-cache-dir", str(tmp / f"{name}-inductor")) if args.compile else ()
        for name in trees
    }
    load0 = os.getloadavg()
    res = {k: {"image": [], "exit": [], "ready": [], "stop": []} for k in trees}
    images = {}
    for rnd in range(args.repeats + 1):
        for name, tree in trees.items():  # alternating: peer, this, peer, this, ...
            g = generate(tree, tmp / f"{name}-{rnd}.png", extra=extra[name])
            s = serve(tree, tmp / f"{name}-serve-{rnd}", extra=extra[name])
            images[name] = (tmp / f"{name}-{rnd}.png").read_bytes()
            tag = "warm-up" if rnd == 0 else f"round {rnd}"
            print(
                f"{tag} {name}: image {g['image']:.2f} s, exit {g['exit']:.2f} s, "
                f"serve ready {s['ready']:.2f} s, stop {s['stop']:.2f} s",
                flush=True,
            )
            if rnd == 0:
                continue
            for k in ("image", "exit"):
                res[name][k].append(g[k])
            for k in ("ready", "stop"):
                res[name][k].append(s[k])
    same = images["peer"] == images["this"]
    breakdown = {
        name: [] if args.no_imports else top_imports(generate(tree, tmp / f"{name}-it.png", True)["stderr"], args.top)
        for name, tree in trees.items()
    }
    load1 = os.getloadavg()
    lines = [
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, load average "
        f"{load0[0]:.2f} at the start, {load1[0]:.2f} at the end; 1 warm-up round (untimed) + {args.repeats} rounds, "
        "peer then this tree in each; medians, wall seconds."
        + (
            " Both commands with `--compile`, each tree's inductor cache warm after the warm-up round."
            if args.compile
            else ""
        ),
        "",
        "| measure | peer (before) | this tree | this / peer | rounds (peer; this) |",
        "|---|---:|---:|---:|---|",
    ]
    labels = {
        "image": "`generate`: image written",
        "exit": "`generate`: process exit",
        "after": "`generate`: exit after the image",
        "ready": "`serve` (1+1+1 workers): /health ok",
        "stop": "`serve`: SIGTERM to the last process gone",
    }
    for name in trees:  # the exit's own cost, less sensitive to the machine's load than either time
        res[name]["after"] = [e - i for e, i in zip(res[name]["exit"], res[name]["image"])]
    for k, label in labels.items():
        p, t = res["peer"][k], res["this"][k]
        rounds = ", ".join(f"{x:.1f}" for x in p) + "; " + ", ".join(f"{x:.1f}" for x in t)
        lines.append(f"| {label} | {med(p):.2f} | {med(t):.2f} | {med(t) / med(p):.2f} | {rounds} |")
    apart = 0.0 if same else pixel_diff(images)
    verdict = "byte-identical" if same else f"DIFFERENT (max abs {apart:.0f}/255 over the pixels)"
    lines += ["", f"The two trees' generated PNGs are {verdict}.", ""]
    if not args.no_imports:
        lines += ["Top imports of one `python -X importtime` generate (cumulative ms; indented: first level):", ""]
        lines += ["| peer | ms | this tree | ms |", "|---|---:|---|---:|"]
        for (a, x), (b, y) in zip(breakdown["peer"], breakdown["this"]):
            lines.append(f"| `{a}` | {x:.0f} | `{b}` | {y:.0f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if not same and not (args.compile and apart <= 1):  # compiled: rounding may move a level
        raise SystemExit("the trees' images differ")


def pixel_diff(images: dict[str, bytes]) -> float:
    import io

    import numpy as np
    from PIL import Image

    a, b = (np.asarray(Image.open(io.BytesIO(images[k])), dtype=np.int16) for k in ("peer", "this"))
    return float(np.abs(a - b).max())


if __name__ == "__main__":
    main()
