"""The denoising step's model FLOP utilisation (MFU) on one GPU: Triptych's step (eager, ``--step-graphs``,
``--compile``, ``--compile --cuda-graphs``, fp8, native attention) beside diffusers' own pipeline (plain,
and with its regional compile).

    python benchmarks/gpu_mfu.py [--device cuda] [--cells flux:1024:1 flux:512:8 ...] [--budget-s 240]
    python benchmarks/gpu_mfu.py --device cpu --tiny        # smoke run of every code path (CPU, seconds)

A cell is ``FAMILY:SIZE:REQUESTS[:VARIANTS]`` (SIZE ``1024``, ``832x480`` or, for video, ``832x480x33``; VARIANTS joined by ``+``,
default every variant the family can run). The full-size transformers (FLUX.1-dev, Qwen-Image, Wan
2.1 T2V 14B, as ``gpu_bench.py`` builds them: random bf16 weights made on the device, no text encoder,
no VAE, the same random prompt embeddings for every contender, ``output_type="latent"``) are rebuilt
for every compiled variant, so no compile sees another's graphs. Per variant: ``--steps`` denoising
steps of REQUESTS requests after a warm-up at the same shapes, synchronized wall time per step.

FLOPs per step are counted once per cell by ``torch.utils.flop_counter.FlopCounterMode`` around one
eager engine step on the device (every row of the batch, both CFG branches where the model has
them; the scheduler's arithmetic is negligible beside the transformer's). MFU = FLOPs per step /
seconds per step / the device's dense peak (``triptych.plan.peaks``: bf16, and fp8 for the fp8 row;
on a CPU its measured fp32 matmul rate). ``fp8`` is ``--quantize transformer=fp8`` (torchao dynamic
float8); its row also gives the PSNR of one step's latents against bf16's from the same start.

Variants:
- ``eager``: Triptych's ``DenoiserEngine``, every request in each tick's one forward, CFG fused;
  attention ``auto`` (the device's best backend, ``core/attention_choice.py``).
- ``step-graphs``: eager with ``SpeedConfig(step_graphs=True)``: the step's transformer forward
  replayed from a CUDA graph per batch bucket (``accel/step_graphs.py``; CUDA only). Its row notes
  the graphs captured and the eager fallbacks, which must be none.
- ``native-attn``: eager with ``--attention native`` (torch SDPA's own pick), the peer of ``auto``.
- ``compile``: the same with ``SpeedConfig(compile=True)`` (regional compile, dynamic shapes).
- ``graphs``: ``compile`` + ``cuda_graphs`` (the families whose compiled block stack replays as CUDA graphs).
- ``fp8``: eager with the transformer's linears in fp8.
- ``diffusers``: one batched ``pipe(...)`` call of the REQUESTS requests.
- ``diffusers-compile``: the same after ``transformer.compile_repeated_blocks(fullgraph=True)``.

Rows print as they are measured: a run stopped by ``--budget-s`` or a time cap keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_bench import ARCHS, build_transformer, conditioning, embeddings, model_dir, run_diffusers  # noqa: E402

VARIANTS = ("eager", "step-graphs", "native-attn", "compile", "graphs", "fp8", "diffusers", "diffusers-compile")
DEFAULT_CELLS = (
    "flux:256:1:eager+step-graphs",  # the CUDA-graph target (>= 1.3x eager at 256² batch 1)
    "flux:1024:1",
    "flux:512:8:eager+compile+diffusers",
    "qwen-image:1024:1:eager+compile+diffusers",
    "qwen-image:256:1:compile+graphs",
    "wan-t2v:832x480x33:1:eager+diffusers",
)
TINY_CELLS = (
    "flux:64:1:eager+native-attn+step-graphs",
    "flux:32:2:eager+diffusers",
    "qwen-image:64:1:eager+fp8+diffusers",
    "wan-t2v:64x32x5:1",
)


@dataclass(frozen=True)
class Cell:
    family: str
    width: int
    height: int
    requests: int
    variants: tuple[str, ...]
    frames: int | None = None  # video: frames per clip (None: the family's benchmark default)

    @classmethod
    def parse(cls, text: str) -> Cell:
        parts = text.split(":")
        if len(parts) not in (3, 4) or parts[0] not in ARCHS:
            raise argparse.ArgumentTypeError(
                f"{text!r}: write FAMILY:SIZE:REQUESTS[:VARIANTS], FAMILY in {list(ARCHS)}"
            )
        w, h, frames = (parts[1].split("x") + [None, None])[:3]
        variants = tuple(parts[3].split("+")) if len(parts) == 4 else VARIANTS
        unknown = set(variants) - set(VARIANTS)
        if unknown:
            raise argparse.ArgumentTypeError(f"{text!r}: unknown variants {sorted(unknown)}; known {list(VARIANTS)}")
        return cls(parts[0], int(w), int(h or w), int(parts[2]), variants, int(frames) if frames else None)

    @property
    def label(self) -> str:
        size = f"{self.width}²" if self.width == self.height else f"{self.width}x{self.height}"
        size += f"x{self.frames}f" if self.frames else ""
        return f"{self.family} {size} x{self.requests}"


def peaks(device: torch.device) -> tuple[str, float, float | None]:
    """(device name, bf16 peak FLOP/s, fp8 peak FLOP/s or None)."""
    from triptych.plan.peaks import cpu_peak, lookup

    if device.type != "cuda":
        p = cpu_peak()
        return p.name, p.bf16, None
    name = torch.cuda.get_device_name(device)
    p = lookup(name)
    if p is None:
        raise SystemExit(f"{name}: not in triptych.plan.peaks' table; add its dense bf16/fp8 peaks")
    return name, p.bf16, p.fp8


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def family_for(arch, d: Path, device: str, dtype: str, speed=None, attention: str = "auto"):
    """The denoiser family with a freshly built random transformer (``gpu_bench.load_denoiser`` plus a
    speed config and an attention backend, applied by the family's own load)."""
    from triptych.accel import SpeedConfig
    from triptych.core.devices import DeviceConfig
    from triptych.families.base import Role
    from triptych.families.registry import family_class

    transformer = build_transformer(
        arch, d / "transformer" / "config.json", torch.device(device), getattr(torch, dtype)
    )
    base = family_class(d)
    adapter = type(
        f"Prebuilt{base.__name__}", (base,), {"_build_components": lambda self, wanted: {"transformer": transformer}}
    )
    return adapter(
        d,
        roles={Role.DENOISER},
        device=DeviceConfig(device=device, dtype=dtype, attention=attention),
        speed=speed or SpeedConfig(),
    )


def engine_for(arch, family, emb, cell: Cell, steps: int):
    """A ``DenoiserEngine`` holding the cell's requests (each tick: every request in one forward)."""
    from triptych.engine import DenoiserEngine, EngineConfig
    from triptych.families.base import GenerationParams

    engine = DenoiserEngine(
        family, EngineConfig(max_batch_requests=cell.requests, max_batch_tokens=2**62, fuse_cfg=True)
    )
    neg = None if arch.family == "flux" else "-"
    frames = cell.frames or arch.frames
    for i in range(cell.requests):
        params = GenerationParams("-", neg, cell.height, cell.width, frames, steps, arch.guidance, seed=i)
        engine.add(family.prepare(f"r{i}", family.resolve(params), conditioning(arch, family, emb, i)))
    return engine


def step_flops(arch, family, emb, cell: Cell) -> float:
    """FLOPs of one engine step of the cell (eager, counted on the device)."""
    from torch.utils.flop_counter import FlopCounterMode

    engine = engine_for(arch, family, emb, cell, steps=2)
    with FlopCounterMode(display=False) as counter:
        engine.step()
    return float(counter.get_total_flops())


def seconds_per_step(run, steps: int, repeats: int, device: torch.device) -> float:
    """Best of ``repeats`` synchronized runs of ``run(steps)``, per step (after one warm-up run)."""
    run(2)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        run(steps)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best / steps


def triptych_run(arch, family, emb, cell: Cell):
    return lambda steps: engine_for(arch, family, emb, cell, steps).run_until_done()


def first_step_latents(arch, family, emb, cell: Cell) -> torch.Tensor:
    """Every request's latents after a one-step denoise from the same start (fp8 against bf16)."""
    finished = engine_for(arch, family, emb, cell, steps=1).run_until_done()
    return torch.cat([s.latents.float().cpu() for s in sorted(finished, key=lambda s: s.request_id)])


def psnr_db(a: torch.Tensor, b: torch.Tensor) -> float:
    peak = float(b.abs().max()) or 1.0
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(peak**2 / mse)).item()


def measure_cell(cell: Cell, root: Path, args, peak: tuple, deadline: float) -> list[dict]:
    from triptych.accel import SpeedConfig
    from triptych.core.devices import DeviceConfig
    from triptych.families.registry import family_class

    arch, device = ARCHS[cell.family], torch.device(args.device)
    d = model_dir(arch, root, args.tiny)
    rows: list[dict] = []
    held = {"plain": family_for(arch, d, args.device, args.dtype)}  # one full-size model on the device at a time
    emb = embeddings(arch, held["plain"], cell.requests)
    flops = step_flops(arch, held["plain"], emb, cell)
    auto_attention = DeviceConfig(device=args.device, dtype=args.dtype).attention_backend(
        family_class(d).attention_masks
    )
    bf16_latents = first_step_latents(arch, held["plain"], emb, cell) if "fp8" in cell.variants else None

    def record(variant: str, seconds: float, fmt: str = "bf16", **extra):
        rate = peak[2] if fmt == "fp8" else peak[1]
        row = dict(cell=cell.label, variant=variant, s_per_step=seconds, tflop=flops / 1e12, **extra)
        row["mfu"] = flops / seconds / rate if rate else None
        row["mfu_bf16_peak"] = flops / seconds / peak[1]
        rows.append(row)
        print(table_row(row, rows), flush=True)

    def swap(speed=None, attention="auto"):
        """The model on the device replaced by one loaded with ``speed`` and ``attention`` (None, auto: a
        fresh plain one)."""
        held.clear()
        free(device)
        plain = speed is None and attention == "auto"
        held["plain" if plain else "other"] = family_for(arch, d, args.device, args.dtype, speed, attention)
        return next(iter(held.values()))

    def diffusers_run(family):
        return lambda steps: run_diffusers(
            arch, family, emb, slice(0, cell.requests), cell.height, steps, cell.width, cell.frames
        )

    speeds = {
        "step-graphs": SpeedConfig(step_graphs=True),
        "compile": SpeedConfig(compile=True),
        "graphs": SpeedConfig(compile=True, cuda_graphs=True),
        # on a CPU dry run int8 dynamic stands in for fp8 (no fp8 matmul there)
        "fp8": SpeedConfig(quantize=("transformer=fp8" if device.type == "cuda" else "transformer=int8-dynamic",)),
    }
    for variant in cell.variants:
        if time.monotonic() > deadline:
            print(f"{cell.label}: time budget spent, skipped from {variant}", file=sys.stderr)
            break
        # NOTE: no local name keeps a family past its variant: swap() must leave one model on the device
        plain = lambda: held.get("plain") or swap()  # noqa: E731
        try:
            if variant == "eager":
                run = triptych_run(arch, plain(), emb, cell)
                record(variant, seconds_per_step(run, args.steps, args.repeats, device))
            elif variant == "diffusers":
                record(variant, seconds_per_step(diffusers_run(plain()), args.steps, args.repeats, device))
            elif variant == "graphs" and (why := family_class(d).cuda_graphs_refusal()) is not None:
                print(f"{cell.label}: graphs: {why}", file=sys.stderr)
            elif variant == "step-graphs" and device.type != "cuda":
                print(f"{cell.label}: step-graphs: needs a CUDA device; this is {device}", file=sys.stderr)
            elif variant == "native-attn":
                other = swap(attention="native")
                s = seconds_per_step(triptych_run(arch, other, emb, cell), args.steps, args.repeats, device)
                record(variant, s, note=f"eager's auto: {auto_attention}")
            elif variant in speeds:
                other = swap(speeds[variant])
                s = seconds_per_step(triptych_run(arch, other, emb, cell), args.steps, args.repeats, device)
                extra = {}
                if variant == "step-graphs":
                    st = other.step_graphs.stats
                    extra["note"] = f"{st.captures} graphs, {st.replays} replays, eager fallbacks {dict(st.fallbacks)}"
                if variant == "fp8":
                    extra["psnr_vs_bf16"] = psnr_db(first_step_latents(arch, other, emb, cell), bf16_latents)
                record(variant, s, "fp8" if variant == "fp8" and device.type == "cuda" else "bf16", **extra)
            elif variant == "diffusers-compile":
                other = swap(SpeedConfig())
                other.pipe.transformer.compile_repeated_blocks(fullgraph=True)
                record(variant, seconds_per_step(diffusers_run(other), args.steps, args.repeats, device))
        except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others' rows
            print(f"{cell.label}: {variant} failed: {type(e).__name__}: {e}", file=sys.stderr)
        run = other = None
    held.clear()
    free(device)
    return rows


HEADER = "| cell | variant | TFLOP/step | s/step | MFU | vs eager | notes |\n|---|---|---|---|---|---|---|"


def table_row(r: dict, rows: list[dict]) -> str:
    eager = next((x for x in rows if x["cell"] == r["cell"] and x["variant"] == "eager"), None)
    vs = f"{eager['s_per_step'] / r['s_per_step']:.2f}x" if eager else "-"
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
    notes = [r["note"]] if r.get("note") else []
    if r["variant"] == "fp8":
        notes.append(f"{100 * r['mfu_bf16_peak']:.1f}% of the bf16 peak; {r['psnr_vs_bf16']:.1f} dB vs bf16")
    return (
        f"| {r['cell']} | {r['variant']} | {r['tflop']:.4g} | {r['s_per_step']:.4f} | {mfu} | {vs} | "
        f"{'; '.join(notes)} |"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cells", nargs="+", type=Cell.parse, default=None)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=240, help="start no new measurement after this many seconds")
    ap.add_argument("--tiny", action="store_true", help="tiny configs (a CPU smoke run of every code path)")
    args = ap.parse_args(argv)
    args.cells = args.cells or [Cell.parse(c) for c in (TINY_CELLS if args.tiny else DEFAULT_CELLS)]
    if args.tiny:
        args.steps, args.repeats = min(args.steps, 2), 1
    # NOTE: the variants compile the same block classes again (each on a fresh model): past dynamo's
    # default recompile limit the later ones would silently run eager.
    torch._dynamo.config.recompile_limit = 64
    device = torch.device(args.device)
    peak = peaks(device)
    deadline = time.monotonic() + args.budget_s
    print(
        f"device: {peak[0]}; peaks bf16 {peak[1] / 1e12:.4g} TFLOP/s, fp8 "
        + (f"{peak[2] / 1e12:.4g}" if peak[2] else "-")
    )
    print(HEADER, flush=True)
    measured = 0
    with tempfile.TemporaryDirectory(prefix="triptych-gpu-mfu-") as root:
        for cell in args.cells:
            if time.monotonic() < deadline:
                measured += len(measure_cell(cell, Path(root), args, peak, deadline))
    print(f"{measured} measurements", file=sys.stderr)
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())
