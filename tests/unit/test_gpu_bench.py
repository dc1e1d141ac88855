"""benchmarks/gpu_bench.py's CPU-runnable parts: the published architectures build (on the meta device,
no memory) at their known sizes, and the tiny smoke run exercises every contender."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "benchmarks" / "gpu_bench.py")
gpu_bench = importlib.util.module_from_spec(spec)
sys.modules["gpu_bench"] = gpu_bench  # dataclasses look their module up
spec.loader.exec_module(gpu_bench)

# Published transformer sizes (billions of parameters), to one decimal.
PUBLISHED_B = {"flux": 11.9, "qwen-image": 20.4, "wan-t2v": 14.3}


@pytest.mark.parametrize("name", sorted(PUBLISHED_B))
def test_full_size_architectures_match_their_published_size(tmp_path, name):
    arch = gpu_bench.ARCHS[name]
    d = gpu_bench.model_dir(arch, tmp_path, tiny=False)
    model = gpu_bench.build_transformer(arch, d / "transformer" / "config.json", torch.device("meta"), torch.bfloat16)
    billions = sum(p.numel() for p in model.parameters()) / 1e9
    assert round(billions, 1) == PUBLISHED_B[name], billions
    assert all(p.device.type == "meta" for p in model.parameters())  # built where asked, nothing on the CPU


def test_tiny_smoke_run_times_every_contender(capsys):
    assert gpu_bench.main(["--device", "cpu", "--tiny", "--families", "qwen-image", "--sizes", "32"]) == 0
    out = capsys.readouterr().out
    row = [line for line in out.splitlines() if line.startswith("| qwen-image")]
    assert len(row) == 1 and row[0].count("|") == 10
