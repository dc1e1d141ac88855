"""The composition matrix: every feature and every pair of {step batching, fused CFG, CFG parallel,
Ulysses, ring, TeaCache, previews, compile, int8 weight-only, int8 dynamic, fp8, bf16} on the default
model either runs (its image against the plain path's, within the bound beside its measured figure)
or is refused at startup with the reason the command prints. The cells are defined in
``composition_support.py``; the table in docs/speed.md (between the markers) is this test's output,
and the last test fails when the committed table differs from what this run measured.

Regenerate the table (after a change that moves a figure or a cell):
``python -m tests.pipelines.test_composition --write`` (add ``--run-slow`` for the compile cells,
which compile the transformer four times, several minutes on this CPU; without it their committed
rows are kept).

Costs: single-rank cells share one loaded family per variant; the 2-rank cells (CFG parallel,
Ulysses, ring, each alone and with every other feature that runs on ranks) are one launch of 2 gloo
ranks, layout after layout; the pairs of parallel layouts one launch of 4. fp8 is refused on this
CPU (no fp8 matmul: the command's startup check), so its cells read "refused" in a table written on
a CPU; ``tests/pipelines/test_gpu_speed.py`` (gpu-marked) runs fp8 alone on a GPU.

Bounds (torch 2.13, torchao 0.18, one thread; measured beside each): max abs over the decoded image
(floats in [0, 1]) for cells of exact features, 10x the measured figure (0 where it measured 0: CFG
parallel computes each branch as the separate forward does, previews only read); PSNR against the
plain image for cells with a lossy feature (TeaCache, int8, bf16), the measured figure minus 6 dB
(4x the MSE).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.extras import needs_extra
from tests.pipelines.composition_support import (
    BEGIN,
    END,
    PREVIEWS,
    Cell,
    all_cells,
    cell_label,
    markdown,
    parse_rows,
    rank_cells,
    row_line,
    run_cell,
)
from triptych.core.errors import InvalidParam

DOC = Path(__file__).resolve().parents[2] / "docs" / "speed.md"
WRITE = os.environ.get("TRIPTYCH_WRITE_COMPOSITION") == "1"
IMAGE_TOKENS = 16  # 64x64 pixels: an 8x8 latent in 2x2 patches

# cell key → bound: ("max_abs", largest max abs) or ("psnr", lowest dB); measured figure beside each.
BOUNDS: dict[str, tuple[str, float]] = {
    "batch": ("max_abs", 2.6e-05),  # measured 2.56e-06
    "batch+bf16": ("psnr", 46.9),  # measured 53.0 dB
    "batch+cfg": ("max_abs", 2.6e-05),  # measured 2.56e-06
    "batch+compile": ("max_abs", 2.1e-05),  # measured 2.41e-06 (2.09e-06 before the stack's CPU forms)
    "batch+fused": ("max_abs", 3.5e-05),  # measured 3.46e-06
    "batch+int8dyn": ("psnr", 38.7),  # measured 44.7 dB
    "batch+int8wo": ("psnr", 51.7),  # measured 57.8 dB
    "batch+previews": ("max_abs", 2.6e-05),  # measured 2.56e-06
    "batch+ring": ("max_abs", 2.6e-05),  # measured 2.5e-06
    "batch+teacache": ("psnr", 63.1),  # measured 69.1 dB (forecast profile)
    "batch+ulysses": ("max_abs", 2.2e-05),  # measured 2.15e-06
    "bf16": ("psnr", 42.8),  # measured 48.9 dB
    "cfg": ("max_abs", 0.0),  # measured 0
    "cfg+bf16": ("psnr", 42.8),  # measured 48.9 dB
    "cfg+compile": ("max_abs", 2.7e-05),  # measured 3.1e-06 (2.65e-06 before the CPU forms)
    "cfg+int8dyn": ("psnr", 37.8),  # measured 43.8 dB
    "cfg+int8wo": ("psnr", 51.7),  # measured 57.8 dB
    "cfg+previews": ("max_abs", 0.0),  # measured 0
    "cfg+ring": ("max_abs", 2.9e-05),  # measured 2.8e-06
    "cfg+teacache": ("psnr", 63.1),  # measured 69.1 dB (forecast profile)
    "cfg+ulysses": ("max_abs", 2.1e-05),  # measured 2.03e-06
    "compile": ("max_abs", 2.8e-05),  # measured 3.1e-06 (2.74e-06 before the CPU forms)
    "compile+bf16": ("psnr", 48.4),  # measured 54.4 dB (48.9 in an earlier run)
    "compile+int8dyn": ("psnr", 42.3),  # measured 48.3 dB (43.8 in an earlier run)
    "compile+int8wo": ("psnr", 51.7),  # measured 57.8 dB
    "fused": ("max_abs", 3.9e-05),  # measured 3.81e-06
    "fused+bf16": ("psnr", 46.6),  # measured 52.6 dB
    "fused+cfg": ("max_abs", 0.0),  # measured 0
    "fused+compile": ("max_abs", 3.9e-05),  # measured 3.9e-06 (1.64e-06 before the CPU forms)
    "fused+int8dyn": ("psnr", 42.7),  # measured 48.7 dB
    "fused+int8wo": ("psnr", 51.7),  # measured 57.8 dB
    "fused+previews": ("max_abs", 3.9e-05),  # measured 3.81e-06
    "fused+ring": ("max_abs", 3e-05),  # measured 2.98e-06
    "fused+teacache": ("psnr", 63.1),  # measured 69.1 dB (forecast profile)
    "fused+ulysses": ("max_abs", 2.1e-05),  # measured 2.03e-06
    "int8dyn": ("psnr", 37.8),  # measured 43.8 dB
    "int8dyn+bf16": ("psnr", 39.2),  # measured 45.3 dB
    "int8wo": ("psnr", 51.7),  # measured 57.8 dB
    "int8wo+bf16": ("psnr", 41.9),  # measured 48.0 dB
    "int8wo+int8dyn": ("psnr", 52.3),  # measured 58.3 dB
    "previews": ("max_abs", 0.0),  # measured 0
    "previews+bf16": ("psnr", 42.8),  # measured 48.9 dB
    "previews+compile": ("max_abs", 3.1e-05),  # measured 3.1e-06 (2.74e-06 before the CPU forms)
    "previews+int8dyn": ("psnr", 37.8),  # measured 43.8 dB
    "previews+int8wo": ("psnr", 51.7),  # measured 57.8 dB
    "ring": ("max_abs", 2.9e-05),  # measured 2.8e-06
    "ring+bf16": ("psnr", 46.6),  # measured 52.6 dB
    "ring+compile": ("max_abs", 3.5e-05),  # measured 3.52e-06 (3.25e-06 before the CPU forms)
    "ring+int8dyn": ("psnr", 39.0),  # measured 45.1 dB
    "ring+int8wo": ("psnr", 51.7),  # measured 57.8 dB
    "ring+previews": ("max_abs", 2.9e-05),  # measured 2.8e-06
    "ring+teacache": ("psnr", 63.1),  # measured 69.1 dB (forecast profile)
    "teacache": ("psnr", 63.1),  # measured 69.1 dB (forecast profile)
    "teacache+bf16": ("psnr", 43.9),  # measured 49.9 dB
    "teacache+compile": ("psnr", 63.1),  # measured 69.1 dB (forecast profile)
    "teacache+int8dyn": ("psnr", 39.3),  # measured 45.3 dB
    "teacache+int8wo": ("psnr", 51.3),  # measured 57.3 dB
    "teacache+previews": ("psnr", 63.1),  # measured 69.1 dB (forecast profile)
    "ulysses": ("max_abs", 2.1e-05),  # measured 2.03e-06
    "ulysses+bf16": ("psnr", 44.7),  # measured 50.7 dB
    "ulysses+compile": ("max_abs", 2.6e-05),  # measured 2.62e-06 (4.35e-06 in an earlier run)
    "ulysses+int8dyn": ("psnr", 36.9),  # measured 43.0 dB
    "ulysses+int8wo": ("psnr", 51.7),  # measured 57.8 dB
    "ulysses+previews": ("max_abs", 2.1e-05),  # measured 2.03e-06
    "ulysses+teacache": ("psnr", 63.1),  # measured 69.1 dB (forecast profile)
}

#: Graphs a CFG-parallel follower compiles in its warm-up (measured: the shapes of engine/warmup.py
#: that reach one CFG half, through the compiled block stack: one row and several; 7 before
#: ``fast_stack.stack_inputs``).
FOLLOWER_GRAPHS = 2

ROWS: dict[str, dict] = {}  # this run's cells, for the table
IMAGES: dict[str, torch.Tensor] = {}  # cell key → image (previews cells compare with their cell without)


def refusal(cell: Cell) -> InvalidParam | None:
    """What the commands' startup check says of the cell's flags (``generate``, ``serve``, ``worker``
    and ``quality`` call it before anything loads): the error, or None when it may run."""
    from triptych.accel.apply import check_speed

    try:
        cell.parallel()  # the flags' dataclass: a ValueError is an argparse error at startup
    except ValueError as e:
        flags = " ".join(f"--{'cfg-parallel' if k == 'cfg' else k} {v}" for k, v in cell.degrees.items())
        return InvalidParam(flags, "", str(e))
    try:
        check_speed(cell.speed(), "cpu")
    except InvalidParam as e:
        return e
    return None


#: cell → the words its refusal must carry (the rest of the cells must not be refused).
def expected_refusal(cell: Cell) -> str | None:
    if cell.has("fp8"):
        return "fp8 needs a CUDA device"
    if cell.has("ulysses") and cell.has("ring"):
        return "needs even shards"
    return None


CELLS = all_cells()
REFUSED = [c for c in CELLS if expected_refusal(c)]
SINGLE = [c for c in CELLS if c not in REFUSED and c.ranks == 1]
MULTI = [c for c in CELLS if c not in REFUSED and c.ranks > 1]


def _quantized(cell: Cell) -> bool:
    return cell.has("int8wo") or cell.has("int8dyn")


#: One launch per world size (layout after layout inside it), its compile cells in a launch of their
#: own (slow: every rank compiles), its int8 cells in one more (they need the quant extra); 6 ranks
#: (CFG 2 x Ulysses 3) is slow here.
LAUNCHES = sorted({(c.ranks, c.has("compile"), _quantized(c)) for c in MULTI})


def _marks(cell: Cell):
    marks = [pytest.mark.slow] if cell.has("compile") else []  # each compiled variant compiles for minutes
    if _quantized(cell):
        marks.append(needs_extra("quant"))
    return marks


def _engine(family, config):
    from triptych.engine import DenoiserEngine
    from triptych.engine.teacache import make_teacache

    return DenoiserEngine(family, config, accel=make_teacache(family))


@pytest.fixture(scope="module")
def model_dir():
    from triptych.families.models import default_model_dir

    return str(default_model_dir())


@pytest.fixture(scope="module")
def families(model_dir, tmp_path_factory):
    """Loaded families by variant (dtype, SpeedConfig), each loaded once."""
    import dataclasses

    from triptych.families.registry import load_family

    cache, inductor = {}, tmp_path_factory.mktemp("inductor")

    def get(cell: Cell):
        if cell.variant not in cache:
            speed = cell.speed()
            if speed.compile:
                speed = dataclasses.replace(speed, compile_cache_dir=inductor)
            cache[cell.variant] = load_family(model_dir, dtype=cell.dtype, speed=speed)
        return cache[cell.variant]

    return get


@pytest.fixture(scope="module")
def plain(model_dir, families):
    """The plain path's image, checked bit-identical to a pristine diffusers pipeline's ``__call__``."""
    from tests.helpers import pristine_pipeline, qwen_reference
    from tests.pipelines.composition_support import PROMPT
    from triptych.families.base import GenerationParams

    family = families(Cell(()))
    image = run_cell(family, Cell(()), _engine)["image"]
    params = family.resolve(GenerationParams(prompt=PROMPT, seed=3))
    reference = qwen_reference(pristine_pipeline(model_dir), params)
    assert np.abs(image.numpy() - reference.reshape(image.shape)).max() == 0.0  # the stage split is exact
    return image


def record(cell: Cell, result: dict, plain: torch.Tensor) -> None:
    """Check one cell's run against the plain image and its bound; keep its row for the table."""
    from triptych.calibration.metrics import psnr

    image = result["image"]
    assert image.shape == plain.shape
    metric = "psnr" if cell.lossy else "max_abs"
    figure = psnr(image.numpy(), plain.numpy()) if cell.lossy else float((image - plain).abs().max())
    notes = []
    if cell.has("teacache"):
        assert result["skipped"] > 0, f"{cell.key}: TeaCache skipped nothing"
        notes.append(f"{result['skipped']} rows skipped")
    if cell.has("previews"):
        assert len(result["previews"]) == PREVIEWS, f"{cell.key}: previews {result['previews']}"
        without = "+".join(f for f in cell.features if f != "previews") or None
        if without is None or without in IMAGES:  # previews change nothing: the image without them, exactly
            assert torch.equal(image, IMAGES[without] if without else plain), f"{cell.key}: previews moved the image"
            notes.append("= without previews")
    if cell.has("batch"):
        assert result["widest"] == 2, f"{cell.key}: the two requests never shared a step"
    IMAGES[cell.key] = image
    assert cell.key in BOUNDS, f"{cell.key}: no bound; measured {metric} {figure!r}"
    bound_kind, bound = BOUNDS[cell.key]
    row = dict(status="works", metric=metric, figure=figure, bound=bound, note=", ".join(notes))
    ROWS[cell.key] = row
    print(f"{cell.key}: {metric} {figure:.3g} (bound {bound:.3g}) {row['note']}")
    assert bound_kind == metric, f"{cell.key}: bound kind {bound_kind} != {metric}"
    if metric == "psnr":
        assert figure >= bound, f"{cell.key}: PSNR {figure:.1f} dB < {bound:.1f} dB"
    else:
        assert figure <= bound, f"{cell.key}: max abs {figure:.3g} > {bound:.3g}"


@pytest.mark.parametrize("cell", [pytest.param(c, id=c.key, marks=_marks(c)) for c in SINGLE])
def test_single_rank_cell(cell, families, plain):
    record(cell, run_cell(families(cell), cell, _engine), plain)


@pytest.mark.parametrize("cell", [pytest.param(c, id=c.key) for c in REFUSED])
def test_refused_cell_is_refused_at_startup_with_the_reason(cell):
    error = refusal(cell)
    assert error is not None, f"{cell.key}: expected a refusal at startup"
    assert expected_refusal(cell) in str(error), str(error)
    reason = f"`{error.field}`: {error.rule}"
    if cell.has("ulysses") and cell.has("ring"):  # and the other setting does not fit the default model
        reason += f"; with even shards the default model's {IMAGE_TOKENS} image tokens do not divide by {cell.ranks}"
    ROWS[cell.key] = dict(status="refused", where="startup", reason=reason)


@pytest.mark.parametrize("quantized", [False, pytest.param(True, marks=needs_extra("quant"))])
def test_runnable_cells_pass_the_startup_check(quantized):
    for cell in [c for c in SINGLE + MULTI if _quantized(c) == quantized]:
        assert refusal(cell) is None, cell.key


def _launch(model_dir, cells: list[Cell], world: int, plain: torch.Tensor, inductor=None) -> None:
    from triptych.parallel import run_ranks

    keys = [c.key for c in cells]
    # A rank compiling a graph keeps its peers waiting in their next collective: a longer timeout.
    collective_timeout_s = 300 if inductor else 60
    results = run_ranks(
        rank_cells, world, (model_dir, keys, inductor), timeout_s=900, collective_timeout_s=collective_timeout_s
    )
    failures = []
    for cell in cells:
        leader = results[0][cell.key]
        for rank, other in enumerate(results[1:], start=1):  # every rank ends with the same image
            if not torch.equal(other[cell.key]["image"], leader["image"]):
                failures.append(f"{cell.key}: rank {rank}'s image differs from rank 0's")
        for rank, result in enumerate(results if cell.has("compile") else []):  # nothing compiles after the warm-up
            if result[cell.key]["compiled"] != {"unique_graphs": 0, "recompiles": 0}:
                failures.append(f"{cell.key}: rank {rank} compiled after the warm-up: {result[cell.key]['compiled']}")
        try:
            record(cell, leader, plain)
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "\n".join(failures)


def _launch_marks(world: int, compiled: bool, quantized: bool) -> list:
    marks = [pytest.mark.slow] if world > 4 or compiled else []
    return marks + ([needs_extra("quant")] if quantized else [])


@pytest.mark.parametrize(
    "world,compiled,quantized",
    [
        pytest.param(
            w, k, q, id=f"{w}" + ("-compile" if k else "") + ("-int8" if q else ""), marks=_launch_marks(w, k, q)
        )
        for w, k, q in LAUNCHES
    ],
)
def test_multi_rank_cells(world, compiled, quantized, model_dir, plain, tmp_path):
    cells = [c for c in MULTI if (c.ranks, c.has("compile"), _quantized(c)) == (world, compiled, quantized)]
    _launch(model_dir, cells, world, plain, str(tmp_path / "inductor") if compiled else None)


@needs_extra("quant")
def test_follower_ranks_quantize_as_rank_0(model_dir, families):
    """The multi-rank cells above load every rank's family themselves; a served or ``generate``
    instance's followers load theirs in ``worker/ranks/follower.py`` from rank 0's ``RankSetup``. CFG parallel
    computes the uncond branch on rank 1: its image equals the single-rank quantized image (separate
    CFG forwards) exactly only if rank 1 quantized its transformer as rank 0 did (measured 0; a
    float32 follower is 57.8 dB away, the int8 weight-only cell's figure)."""
    from tests.pipelines.composition_support import PROMPT
    from triptych.engine.runner import run_request
    from triptych.families.base import GenerationParams
    from triptych.parallel import ParallelConfig
    from triptych.worker.ranks.local import run_parallel_request

    family = families(Cell(("int8wo",)))
    params = family.resolve(GenerationParams(prompt=PROMPT, seed=3))
    frames, _ = run_parallel_request(family, params, ParallelConfig(cfg=2), collective_timeout_s=120)
    single, _ = run_request(family, params, fuse_cfg=False)
    diff = float(np.abs(frames.array - single.array).max())
    print(f"CFG-2 with int8 weight-only vs one rank: max abs {diff:.2e}")
    assert diff == 0.0


@pytest.mark.slow  # every rank compiles
def test_follower_ranks_compile_and_warm_up_as_rank_0(families, plain):
    """A served compiled instance (``ParallelDenoiserRunner``) starts its ranks with ``warm_up``: the
    follower (``worker/ranks/follower.py``) compiles its transformer's blocks from rank 0's
    ``RankSetup``, and every rank warms up (``worker/ranks/warmup.py``) before the worker registers.
    The follower is a fresh process, so its dynamo counters gathered after the warm-up count its own
    compiles: the graphs CFG parallel gives a rank (measured FOLLOWER_GRAPHS; an eager follower 0).
    The request after the warm-up compiles nothing more on rank 0, and its image (CFG-2: rank 1
    computes the uncond branch with its compiled blocks) matches the plain path within the
    CFG parallel x compile cell's bound."""
    from tests.pipelines.composition_support import PROMPT
    from triptych.accel.compile import compile_counts
    from triptych.engine import EngineConfig
    from triptych.families.base import GenerationParams
    from triptych.parallel import ParallelConfig
    from triptych.worker.ranks.instance import InstanceRanks
    from triptych.worker.ranks.local import denoise_on_ranks

    family = families(Cell(("compile",)))
    params = family.resolve(GenerationParams(prompt=PROMPT, seed=3))
    config = EngineConfig(max_batch_requests=1)
    ranks = InstanceRanks(ParallelConfig(cfg=2), collective_timeout_s=300, threads=1)
    ranks.start(family, str(family.model_dir), "cpu", None, config, warm_up=True)
    try:
        warm, after_warm_up = ranks.warmup_counts, compile_counts()
        with torch.no_grad():
            flat = family.encode(params).flat()
        state = denoise_on_ranks(family, params, flat, ranks, config)
        after_request = compile_counts()
    finally:
        ranks.close()
    with torch.no_grad():
        image = torch.from_numpy(family.decode(state.latents, params).array.astype(np.float32))
    diff = float((image - plain).abs().max())
    print(f"CFG-2 compiled, warm-up counters per rank {warm}; after the request {after_request}; max abs {diff:.2e}")
    assert len(warm) == 2 and warm[1] == {"unique_graphs": FOLLOWER_GRAPHS, "recompiles": 0}
    assert after_request == after_warm_up
    assert diff <= BOUNDS["cfg+compile"][1]


def _figure(line: str) -> tuple[str, float] | None:
    column = [p.strip() for p in line.strip("| ").split("|")][2]
    if column.startswith("0 (bit-identical)"):
        return "max_abs", 0.0
    m = re.match(r"(max abs|PSNR) ([-+0-9.e]+)", column)
    return (m.group(1), float(m.group(2))) if m else None


def _same_figure(fresh: str, committed: str) -> bool:
    """Figures move a little between machines (CPU kernels): a max abs within 10x, a PSNR within 6 dB."""
    a, b = _figure(fresh), _figure(committed)
    if a is None or b is None:
        return a == b
    if a[0] != b[0]:
        return False
    if a[0] == "PSNR":
        return abs(a[1] - b[1]) <= 6.0
    return (a[1] == 0) == (b[1] == 0) and (a[1] == 0 or 0.1 <= a[1] / b[1] <= 10)


def _strip_figure(line: str) -> list[str]:
    parts = [p.strip() for p in line.strip("| ").split("|")]
    return parts[:2] + parts[3:]


def test_committed_table_is_what_this_run_measured():
    """docs/speed.md's section between the markers equals this run's table (the cells that ran: a
    deselected or skipped cell keeps its committed row), figures within the machines' spread."""
    text = DOC.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"{DOC}: the composition markers are missing"
    head, rest = text.split(BEGIN)
    committed, tail = rest.split(END)
    kept = parse_rows(committed)
    if WRITE:
        DOC.write_text(head + markdown(ROWS, kept) + tail)
        return
    assert {cell_label(c) for c in CELLS} <= set(kept), "cells missing from the committed table: regenerate it"
    problems = []
    for cell in CELLS:
        if cell.key not in ROWS:
            continue
        fresh, old = row_line(cell, ROWS[cell.key]), kept[cell_label(cell)]
        if _strip_figure(fresh) != _strip_figure(old) or not _same_figure(fresh, old):
            problems.append(f"committed: {old}\nthis run:  {fresh}")
    assert not problems, "the committed composition table differs (regenerate it, see the module docstring):\n" + (
        "\n".join(problems)
    )
    assert markdown({}, kept) == BEGIN + committed + END, "the committed grid does not match its rows: regenerate it"


if __name__ == "__main__":
    if "--write" not in sys.argv[1:]:
        raise SystemExit("usage: python -m tests.pipelines.test_composition --write [--run-slow]")
    os.environ["TRIPTYCH_WRITE_COMPOSITION"] = "1"
    args = [a for a in sys.argv[1:] if a != "--write"]
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", *args]))
