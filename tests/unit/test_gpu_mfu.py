"""benchmarks/gpu_mfu.py's CPU-runnable parts: the cell syntax, and the tiny dry run through each
variant's code path (the compiled ones are slow-marked: each compiles on the CPU)."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
spec = importlib.util.spec_from_file_location("gpu_mfu", ROOT / "benchmarks" / "gpu_mfu.py")
gpu_mfu = importlib.util.module_from_spec(spec)
sys.modules["gpu_mfu"] = gpu_mfu  # dataclasses look their module up
spec.loader.exec_module(gpu_mfu)

ROW = re.compile(
    r"^\| (?P<cell>[^|]+) \| (?P<variant>[\w-]+) \| (?P<tflop>[\d.e+-]+) \| (?P<s>[\d.]+) \| (?P<mfu>[\d.]+)% \|"
)


def test_a_cell_names_family_size_frames_requests_and_variants():
    cell = gpu_mfu.Cell.parse("wan-t2v:832x480x33:2:eager+diffusers")
    assert (cell.family, cell.width, cell.height, cell.frames, cell.requests) == ("wan-t2v", 832, 480, 33, 2)
    assert cell.variants == ("eager", "diffusers")
    assert gpu_mfu.Cell.parse("flux:1024:1").variants == gpu_mfu.VARIANTS
    for bad in ("flux:1024", "nope:64:1", "flux:64:1:eager+warp"):
        with pytest.raises(argparse.ArgumentTypeError):
            gpu_mfu.Cell.parse(bad)


def rows(out: str) -> list[dict]:
    return [m.groupdict() for line in out.splitlines() if (m := ROW.match(line))]


@pytest.mark.parametrize(
    "variants",
    [
        pytest.param(["eager", "diffusers"], id="eager"),
        pytest.param(["eager", "compile", "diffusers-compile"], id="compiled", marks=pytest.mark.slow),
    ],
)
def test_tiny_dry_run_measures_each_variant_with_an_mfu_in_range(capsys, variants):
    assert gpu_mfu.main(["--device", "cpu", "--tiny", "--cells", "flux:32:2:" + "+".join(variants)]) == 0
    found = rows(capsys.readouterr().out)
    assert [r["variant"] for r in found] == variants
    for r in found:
        assert float(r["tflop"]) > 0 and 0 < float(r["mfu"]) <= 100, r
    assert len({r["tflop"] for r in found}) == 1  # one count per cell: every variant does the same math


def test_graphs_are_refused_where_the_family_has_no_stack(capsys):
    assert gpu_mfu.main(["--device", "cpu", "--tiny", "--cells", "flux:32:1:eager+graphs"]) == 0
    captured = capsys.readouterr()
    assert [r["variant"] for r in rows(captured.out)] == ["eager"]
    assert "graphs: flux has no compiled block stack" in captured.err


def test_step_graphs_are_refused_off_cuda_and_native_attention_is_measured_beside_auto(capsys):
    assert gpu_mfu.main(["--device", "cpu", "--tiny", "--cells", "flux:32:1:eager+step-graphs+native-attn"]) == 0
    captured = capsys.readouterr()
    found = rows(captured.out)
    assert [r["variant"] for r in found] == ["eager", "native-attn"]
    assert "step-graphs: needs a CUDA device; this is cpu" in captured.err
    assert "eager's auto: native" in captured.out  # on a CPU auto is native: the two rows run the same kernels
