"""Served throughput at 1 / 4 / 8 concurrent requests on the default model, against plain diffusers.

Issue 27's served figure: images per second of ``triptych serve`` (the built-in default model,
64x64, 20 steps, true CFG 4 with the negative prompt " ", as a bare ``serve`` runs it) with ``C``
clients each sending its requests back to back (closed loop), against plain diffusers'
``QwenImagePipeline.__call__`` in this process on the same requests one after another (the images/s
one pipeline gives, whatever the concurrency), and against the same server run from an older
checkout (``--before DIR``: that tree's code, imported through ``PYTHONPATH``, this venv; with
``--before-compiled`` also that tree's ``serve --compile``, 'compiled before'); with
``--compiled`` also this tree's ``serve --compile`` (its warm-up before it registers included in
its start, not in the figures); with ``--compiled-denoisers N`` also ``serve --compile --denoisers N``
(N denoiser processes of one thread each: on this 2-core machine one denoiser keeps one core busy
and leaves most of the other idle); with ``--denoiser-threads N`` also ``serve --compile
--denoiser-threads N`` ('compiled dNt': the one denoiser on N torch threads, the other workers on
one) and, as its fair peer, diffusers' ``__call__`` on N threads ('diffusers Nt'; its ratio columns
are the served systems' images/s over its own).

Per repeat the systems alternate (order rotated) at every concurrency, each warmed up first. Every
server is one encoder, one denoiser, one decoder (a bare ``serve``), one torch thread per process,
ZMQ transfer. Served images are compared with diffusers' image of the same seed (PSNR, worst
request). Prints a markdown table and writes ``--out`` JSON.

    python benchmarks/served_concurrency.py --before /tmp/before --repeats 2 --out /tmp/served.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from serving import ROUTE, InProc, Server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CALL = {"negative_prompt": " ", "true_cfg_scale": 4.0}  # the served defaults of the default model


def body(i: int, steps: int) -> dict:
    return {"prompt": f"object {i} on a plain background", "size": "64x64", "seed": i, "num_inference_steps": steps}


def pixels_of(b64: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


class Diffusers(InProc):
    """Plain diffusers, one request at a time, on ``threads`` torch threads; keeps each image for the
    comparison (the one-thread peer's images are the reference)."""

    def __init__(self, model: str, extra: dict, threads: int = 1):
        super().__init__(model, extra)
        self.threads = threads
        self.name = "diffusers" if threads == 1 else f"diffusers {threads}t"

    def image(self, b: dict) -> np.ndarray:
        gen = self.torch.Generator("cpu").manual_seed(b["seed"])
        self.torch.set_num_threads(self.threads)  # in the thread that runs it (OpenMP's count is per thread)
        try:
            out = self.pipe(
                prompt=b["prompt"],
                generator=gen,
                height=64,
                width=64,
                num_inference_steps=b["num_inference_steps"],
                **CALL,
            )
        finally:
            self.torch.set_num_threads(1)
        return np.asarray(out.images[0].convert("RGB"))

    async def run(self, bodies: list[dict]) -> list[np.ndarray]:
        return [await asyncio.to_thread(self.image, b) for b in bodies]  # one pipeline: sequential


class Served:
    def __init__(self, server: Server):
        self.name, self.server = server.name, server
        self.client = httpx.AsyncClient(base_url=server.base, timeout=900)

    async def one(self, b: dict) -> np.ndarray:
        r = await self.client.post(ROUTE, json={**b, "response_format": "b64_json"})
        r.raise_for_status()
        return pixels_of(r.json()["data"][0]["b64_json"])

    async def run(self, bodies: list[dict], clients: int) -> list[np.ndarray]:
        out: list[np.ndarray | None] = [None] * len(bodies)
        queue = list(range(len(bodies)))

        async def client():
            while queue:
                i = queue.pop(0)
                out[i] = await self.one(bodies[i])

        await asyncio.gather(*(client() for _ in range(clients)))
        return out


async def measure(systems, args) -> list[dict]:
    rows, reference = [], {}
    for rep in range(args.repeats):
        order = systems[rep % len(systems) :] + systems[: rep % len(systems)]
        for c in args.concurrency:
            n = args.per_client * c
            bodies = [body(10_000 * rep + 100 * c + k, args.steps) for k in range(n)]
            for s in order:
                warm = [body(900 + k, args.steps) for k in range(2)]
                await (s.run(warm) if isinstance(s, Diffusers) else s.run(warm, 2))
                t = time.perf_counter()
                images = await (s.run(bodies) if isinstance(s, Diffusers) else s.run(bodies, c))
                span = time.perf_counter() - t
                if isinstance(s, Diffusers) and s.threads == 1:
                    reference.update({b["seed"]: im for b, im in zip(bodies, images)})
                row = {"system": s.name, "repeat": rep, "clients": c, "n": n, "span_s": span, "images_per_s": n / span}
                row["_images"] = {b["seed"]: im for b, im in zip(bodies, images)}
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "_images"}), flush=True)
    for row in rows:  # quality against diffusers' image of the same seed (diffusers ran every body)
        dbs = [psnr(im, reference[seed]) for seed, im in row.pop("_images").items() if seed in reference]
        row["worst_psnr_db"] = min(dbs) if dbs else None
    return rows


def table(rows: list[dict], args) -> str:
    names = list(dict.fromkeys(r["system"] for r in rows))
    out = ["| clients | " + " | ".join(f"{n} images/s" for n in names) + " | "]
    out[0] += " | ".join(f"{n} ÷ diffusers" for n in names if n != "diffusers")
    peers_nt = [n for n in names if n.startswith("diffusers ")]  # diffusers on N threads
    served = [n for n in names if not n.startswith("diffusers")]
    out[0] += "".join(f" | {n} ÷ {p}" for p in peers_nt for n in served)
    out[0] += " | this ÷ before" if "before" in names else ""
    out[0] += " | compiled ÷ compiled before |" if "compiled before" in names else " |"
    out[0] += " worst PSNR vs diffusers dB (this tree) |"
    cols = 2 * len(names) + 1 + len(peers_nt) * len(served) + ("before" in names) + ("compiled before" in names)
    out.append("|---" * cols + "|")
    for c in args.concurrency:
        best = {
            n: max(r["images_per_s"] for r in rows if r["system"] == n and r["clients"] == c) for n in names
        }  # best repeat of each
        cells = [f"{best[n]:.2f}" for n in names]
        cells += [f"{best[n] / best['diffusers']:.2f}x" for n in names if n != "diffusers"]
        cells += [f"{best[n] / best[p]:.2f}x" for p in peers_nt for n in served]
        if "before" in names:
            cells.append(f"{best['serve'] / best['before']:.2f}x")
        if "compiled before" in names:
            cells.append(f"{best['compiled'] / best['compiled before']:.2f}x")
        worst = min(
            r["worst_psnr_db"]
            for r in rows
            if r["clients"] == c and r["system"].startswith(("serve", "compiled")) and "before" not in r["system"]
        )
        cells.append(f"{worst:.1f}")
        out.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--per-client", type=int, default=4, help="requests per client at each concurrency")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--before", help="an older checkout: its `triptych serve` is the 'before' system")
    ap.add_argument("--compiled", action="store_true", help="also this tree's `serve --compile` ('compiled')")
    ap.add_argument(
        "--before-compiled",
        action="store_true",
        help="with --before and --compiled: also the older checkout's `serve --compile` ('compiled before')",
    )
    ap.add_argument(
        "--compiled-denoisers",
        type=int,
        default=0,
        metavar="N",
        help="also `serve --compile --denoisers N` ('compiled xN'): N denoiser processes, one thread each",
    )
    ap.add_argument(
        "--denoiser-threads",
        type=int,
        default=0,
        metavar="N",
        help="also `serve --compile --denoiser-threads N` ('compiled dNt') and diffusers on N threads ('diffusers Nt')",
    )
    ap.add_argument("--out", default="/tmp/served_concurrency.json")
    args = ap.parse_args()
    from triptych.families.models import default_model_dir

    model = str(default_model_dir())
    tmp = tempfile.mkdtemp(prefix="served-")
    base = [sys.executable, "-m", "triptych.cli", "serve", "--model", model, "--threads", "1", "--transfer", "zmq"]
    base += ["--orchestrator-max-queued", "4096", "--max-queued-requests", "4096"]
    specs = {"serve": (ROOT, base)}
    compiled = [*base, "--compile", "--compile-cache-dir", str(Path(tmp) / "inductor")]  # one cache for all
    if args.compiled:
        specs["compiled"] = (ROOT, compiled)
    if args.compiled_denoisers > 1:
        n = args.compiled_denoisers
        specs[f"compiled x{n}"] = (ROOT, [*compiled, "--denoisers", str(n)])
    if args.denoiser_threads > 1:
        n = args.denoiser_threads
        specs[f"compiled d{n}t"] = (ROOT, [*compiled, "--denoiser-threads", str(n)])
    if args.before:
        specs["before"] = (Path(args.before).resolve(), base)
    if args.before and args.compiled and args.before_compiled:  # its own cache: other code, other graphs
        before_cache = ["--compile", "--compile-cache-dir", str(Path(tmp) / "inductor-before")]
        specs["compiled before"] = (Path(args.before).resolve(), [*base, *before_cache])
    servers = []
    try:
        for name, (tree, cmd) in specs.items():
            # The server and its workers import that tree's triptych: PYTHONPATH and the working directory
            # (``python -m`` puts the working directory first on sys.path; before 2026-12-05 the servers
            # started in this tree, so every 'before' system imported this tree's code).
            os.environ["PYTHONPATH"] = str(tree)
            servers.append(Server(name, [*cmd, "--data-dir", str(Path(tmp) / name)], tmp, cwd=tree))
        os.environ["PYTHONPATH"] = str(ROOT)
        for s in servers:
            s.wait(1800)
        peers = [Diffusers(model, CALL)]
        if args.denoiser_threads > 1:
            peers.append(Diffusers(model, CALL, threads=args.denoiser_threads))
        systems = [*peers, *(Served(s) for s in servers)]
        rows = asyncio.run(measure(systems, args))
    finally:
        for s in servers:
            s.stop()
    command = "python benchmarks/served_concurrency.py " + " ".join(sys.argv[1:])
    Path(args.out).write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    print(table(rows, args))


if __name__ == "__main__":
    main()
