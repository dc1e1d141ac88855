"""The composition matrix's cells (``test_composition.py``): what each feature sets, how a cell runs on
one rank or on every rank of a multi-rank instance, and the markdown table the test writes.

A cell is one feature or a pair of features. It runs the same request on the default model (its own
20 steps, 64x64, guidance 4) through the serving engine (``DenoiserEngine``; on several ranks the
engine every rank of an instance builds, ``ranks.ticks.instance_engine``) with the cell's features
on and everything else as the plain path: one request, CFG branches as separate forwards (as
diffusers runs them), float32, eager, one rank. Its image is compared with the plain path's, which
equals diffusers' own ``__call__`` bit for bit (the test checks that first).

Features:

- step batching: a second request (another prompt and seed) shares every forward;
- fused CFG: both branches in one forward (``EngineConfig.fuse_cfg``); CFG parallel always fuses;
- CFG parallel, Ulysses, ring: 2, 3 and 2 ranks (gloo; Ulysses splits the default model's 3 attention
  heads), a pair of them the product;
- TeaCache: ``teacache_threshold`` 0.1 on the request (the shipped 20-step profile);
- previews: 2 ``partial_images``;
- compile: ``SpeedConfig(compile=True)``;
- int8 weight-only, int8 dynamic, fp8: the transformer quantized so (a pair of two modes: the
  transformer in the first, the text encoder in the second; one component takes one mode);
- bf16: the components loaded in bfloat16.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

FEATURES = {
    "batch": "step batching",
    "fused": "fused CFG",
    "cfg": "CFG parallel",
    "ulysses": "Ulysses",
    "ring": "ring",
    "teacache": "TeaCache",
    "previews": "previews",
    "compile": "compile",
    "int8wo": "int8 weight-only",
    "int8dyn": "int8 dynamic",
    "fp8": "fp8",
    "bf16": "bf16",
}
QUANT_MODE = {"int8wo": "int8-weight-only", "int8dyn": "int8-dynamic", "fp8": "fp8"}
PARALLEL = ("cfg", "ulysses", "ring")
#: Degrees: Ulysses splits attention heads, and the default model has 3 (Ulysses 2 is refused:
#: "ulysses=2 does not divide the 3 attention heads of the model").
DEGREE = {"cfg": 2, "ulysses": 3, "ring": 2}
#: Features that change the image on purpose: their cells are held to a PSNR, the rest to a max abs.
LOSSY = {"teacache", "int8wo", "int8dyn", "fp8", "bf16"}
PROMPT, PARTNER = "a red circle on a blue background", "a small green square on a white background"
TEACACHE_THRESHOLD = 0.1
PREVIEWS = 2


@dataclass(frozen=True)
class Cell:
    features: tuple[str, ...]  # one or two, in FEATURES order

    @property
    def key(self) -> str:
        return "+".join(self.features)

    def has(self, name: str) -> bool:
        return name in self.features

    @property
    def lossy(self) -> bool:
        return bool(LOSSY & set(self.features))

    @property
    def degrees(self) -> dict[str, int]:
        return {p: DEGREE[p] for p in PARALLEL if self.has(p)}

    @property
    def ranks(self) -> int:
        return int(np.prod(list(self.degrees.values()), dtype=int))

    @property
    def fused(self) -> bool:
        return self.has("fused") or self.has("cfg")

    def parallel(self):
        from triptych.parallel import ParallelConfig

        return ParallelConfig(**self.degrees)

    def speed(self):
        from triptych.accel import SpeedConfig

        modes = [QUANT_MODE[f] for f in self.features if f in QUANT_MODE]
        quantize = tuple(f"{c}={m}" for c, m in zip(("transformer", "text_encoder"), modes))
        return SpeedConfig(compile=self.has("compile"), quantize=quantize)

    @property
    def dtype(self) -> str | None:
        return "bfloat16" if self.has("bf16") else None

    @property
    def variant(self) -> tuple:
        """What the loaded family depends on (cells with the same variant share one)."""
        return (self.dtype, self.speed())


def all_cells() -> list[Cell]:
    names = list(FEATURES)
    singles = [Cell((n,)) for n in names]
    return singles + [Cell(pair) for pair in itertools.combinations(names, 2)]


def run_cell(family, cell: Cell, make_engine) -> dict:
    """The cell's request (and its batch partner) through ``make_engine(family, EngineConfig)``;
    returns the request's image, the TeaCache rows skipped, the previews handed out, the forwards."""
    from triptych.engine import EngineConfig
    from triptych.engine.previews import preview_steps
    from triptych.families.base import GenerationParams

    engine = make_engine(family, EngineConfig(fuse_cfg=cell.fused))
    threshold = TEACACHE_THRESHOLD if cell.has("teacache") else 0.0
    params = family.resolve(GenerationParams(prompt=PROMPT, seed=3, teacache_threshold=threshold))
    with torch.no_grad():
        state = family.prepare("main", params, family.encode(params))
        if cell.has("previews"):
            state.preview_steps = preview_steps(PREVIEWS, state.total_steps)
        engine.add(state)
        if cell.has("batch"):
            other = family.resolve(GenerationParams(prompt=PARTNER, seed=11))
            engine.add(family.prepare("partner", other, family.encode(other)))
        previews, widest = [], 0
        while engine.has_work():  # every rank schedules the same batch: same states, same order
            out = engine.step()
            assert not out.failed, out.failed
            widest = max(widest, len(out.batch))
            previews += [step for rid, _, step, _, x0 in out.previews if rid == "main"]
        image = family.decode(state.latents, params).array.astype(np.float32)
    return dict(
        image=torch.from_numpy(image),
        skipped=int(engine.stats.skipped_rows),
        previews=previews,
        forwards=int(engine.stats.forwards),
        widest=widest,
    )


def _rank_engine(parallelism):
    from triptych.worker.ranks.ticks import instance_engine

    return lambda family, config: instance_engine(family, config, parallelism)


def rank_cells(rank: int, device, model_dir: str, keys: list[str], inductor: str | None = None) -> dict:
    """Every cell of ``keys`` on this rank of one launch, layout after layout (module level: spawned
    ranks import it). Each layout's groups are built, attached to the family, run, removed. A
    compiling cell warms every rank up first, as a served instance does (``ranks/warmup.py``; and the
    compiled VAE decoder, which a served decoder warms up before it registers), and reports the graphs
    its request compiled after that (``compiled``); ``inductor``: their compile cache directory (every
    rank shares it)."""
    import dataclasses
    from pathlib import Path

    from triptych.accel.compile import compile_counts
    from triptych.engine.warmup import warm_up_decoder
    from triptych.families.registry import load_family
    from triptych.parallel import ParallelGroups, apply_parallel
    from triptych.worker.ranks.warmup import warm_up_ranks

    torch.set_num_threads(1)
    cells = [Cell(tuple(k.split("+"))) for k in keys]
    families, out = {}, {}
    for cell in cells:
        if cell.variant not in families:
            speed = cell.speed()
            if speed.compile and inductor:
                speed = dataclasses.replace(speed, compile_cache_dir=Path(inductor))
            families[cell.variant] = load_family(model_dir, dtype=cell.dtype, speed=speed)
        family = families[cell.variant]
        groups = ParallelGroups.build(cell.parallel(), device)
        parallelism = apply_parallel(family.pipe.transformer, groups)
        try:
            if cell.has("compile"):
                warm_up_ranks(family, parallelism, groups)
                if family.compile_vae_decoder:  # the cell decodes here; served, the decoder role warms it up
                    warm_up_decoder(family)
                warm = compile_counts()
            result = run_cell(family, cell, _rank_engine(parallelism))
            if cell.has("compile"):
                result["compiled"] = {k: n - warm[k] for k, n in compile_counts().items()}
        finally:
            parallelism.remove()
        out[cell.key] = result if rank == 0 else {k: v for k, v in result.items() if k in ("image", "compiled")}
    return out


# ---- the table -------------------------------------------------------------------------------------

BEGIN = "<!-- composition matrix: generated by tests/pipelines/test_composition.py; do not edit -->"
END = "<!-- end of the composition matrix -->"


def figure_text(row: dict) -> str:
    if row["metric"] == "psnr":
        return f"PSNR {row['figure']:.1f} dB"
    return "0 (bit-identical)" if row["figure"] == 0 else f"max abs {row['figure']:.1e}"


def bound_text(row: dict) -> str:
    if row["metric"] == "psnr":
        return f"≥ {row['bound']:.1f} dB"
    return "= 0" if row["bound"] == 0 else f"≤ {row['bound']:.1e}"


def cell_label(cell: Cell) -> str:
    return " × ".join(FEATURES[f] for f in cell.features)


def row_line(cell: Cell, row: dict) -> str:
    if row["status"] == "refused":
        return f"| {cell_label(cell)} | refused ({row['where']}) | | {row['reason']} |"
    extra = f"; {row['note']}" if row.get("note") else ""
    return f"| {cell_label(cell)} | works | {figure_text(row)}{extra} | {bound_text(row)} |"


def markdown(rows: dict[str, dict], kept: dict[str, str] | None = None) -> str:
    """The generated section: a grid (✓ works, ✗ refused) and one row per cell. ``rows``: this run's
    cells; ``kept``: committed lines (by cell label) for the cells this run did not run."""
    kept = kept or {}
    lines_by_key = {}
    for cell in all_cells():
        if cell.key in rows:
            lines_by_key[cell.key] = row_line(cell, rows[cell.key])
        elif cell_label(cell) in kept:
            lines_by_key[cell.key] = kept[cell_label(cell)]
    names = list(FEATURES)
    lines = [BEGIN, "", "| | " + " | ".join(FEATURES[n] for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    for i, a in enumerate(names):
        marks = []
        for j, b in enumerate(names):
            line = lines_by_key.get("+".join(dict.fromkeys((a, b)))) if j >= i else None
            status = line and [p.strip() for p in line.strip("| ").split("|")][1]
            marks.append("" if not status else "✓" if status.startswith("works") else "✗")
        lines.append(f"| **{FEATURES[a]}** | " + " | ".join(marks) + " |")
    lines += ["", "| cell | result | measured against the plain path | bound, or why refused |", "|---|---|---|---|"]
    lines += [lines_by_key[c.key] for c in all_cells() if c.key in lines_by_key]
    lines += ["", END]
    return "\n".join(lines)


def parse_rows(section: str) -> dict[str, str]:
    """cell label → its row of a committed section (for the comparison with a fresh run)."""
    out = {}
    for line in section.splitlines():
        parts = [p.strip() for p in line.strip().strip("|").split("|")]
        if len(parts) == 4 and parts[1].split(" ")[0] in ("works", "refused"):
            out[parts[0]] = line
    return out
