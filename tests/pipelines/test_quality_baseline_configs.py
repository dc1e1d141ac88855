"""``triptych quality --baseline`` beyond "this code": video baselines (frames stored, frame-to-frame
consistency reported and gated) on a tiny Wan T2V, and the configurations under test on a tiny FLUX:
a dtype, the serving engine's step batching (``--served``) and a multi-rank instance (``--ulysses``),
each with the gate ``triptych.calibration.baseline_run`` states for it.

Measured figures (tiny models, CPU float32; the tolerances in ``baseline_run`` are 10x them): served
at batch 4, 3.0e-6 max abs on the frames; Ulysses-2, 2.4e-6; bf16 weights, 0.053 max abs, 42.9 dB.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from triptych import cli
from triptych.calibration.baseline import compare_baseline, temporal_psnr
from triptych.calibration.baseline_run import PARALLEL_TOLERANCE, SERVED_TOLERANCE, Configuration
from triptych.calibration.target import Target
from triptych.core.errors import InvalidParam
from triptych.families.registry import load_family


def _compare(model, root: Path, name: str, *extra: str) -> tuple[int, dict, Path]:
    out = root / name
    code = cli.main(["quality", "--model", model, "--baseline", str(root / "base"), "--report", str(out), *extra])
    return code, json.loads((out / "report.json").read_text()), out


# ---- video ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wan(tiny_model_dir, tmp_path_factory):
    model, root = tiny_model_dir("wan-t2v"), tmp_path_factory.mktemp("wan-baseline")
    (root / "matrix.yaml").write_text("guidance: [5.0]\nframes: [5]\n")  # 2 prompts, 5 frames each
    assert (
        cli.main(
            ["quality", "--model", model, "--save-baseline", str(root / "base"), "--matrix", str(root / "matrix.yaml")]
        )
        == 0
    )
    return model, root


def test_temporal_psnr_is_the_mean_over_consecutive_frames():
    still = np.full((3, 4, 4, 3), 0.5, dtype=np.float32)
    assert temporal_psnr(still[:1]) is None and temporal_psnr(still) == 100.0  # identical frames: capped
    moving = still.copy()
    moving[1] += 0.1  # frame 1 differs from 0 and 2 by 0.1 everywhere: 20 dB each way
    assert temporal_psnr(moving) == pytest.approx(20.0, abs=1e-3)


def test_a_video_baseline_stores_every_frame_and_its_consistency(wan):
    _, root = wan
    meta = json.loads((root / "base" / "baseline.json").read_text())
    tensors = load_file(str(root / "base" / "outputs.safetensors"))
    assert [c["frames"] for c in meta["cases"]] == [5, 5]
    for i, case in enumerate(meta["cases"]):
        frames = tensors[f"{i}.frames"].numpy()
        assert frames.shape == (5, 32, 32, 3) and not np.array_equal(frames[0], frames[-1])  # it moves
        assert case["temporal_psnr"] == pytest.approx(temporal_psnr(frames)) and case["temporal_psnr"] < 100


def test_the_same_code_reports_the_same_frame_consistency_as_the_baseline(wan):
    model, root = wan
    code, report, out = _compare(model, root, "same")
    assert code == 0 and report["kind"] == "exact" and report["summary"]["identical"] == 2
    for r in report["cases"]:
        # Identical frames; the PSNR is computed twice, and its reduction may round differently in the
        # last place (measured 3.6e-15 dB once): equal to 1e-9 dB.
        assert r["frames"] == 5 and r["baseline_temporal_psnr"] is not None
        assert r["temporal_psnr"] == pytest.approx(r["baseline_temporal_psnr"], abs=1e-9)
    assert report["summary"]["temporal_drop_max"] == pytest.approx(0.0, abs=1e-9)
    html = (out / "index.html").read_text()
    assert "frames_0.png" in html and "frame→frame dB" in (out / "report.md").read_text()


def test_an_acceleration_that_breaks_frame_consistency_fails_its_gate(wan, tmp_path):
    """The baseline's case 0 is replaced by a still video (its frame 0 five times, 100 dB between
    frames); the current frames move (measured < 100 dB), so the temporal gate fails while the
    per-frame gates, set to 0 here, cannot."""
    model, root = wan
    base = tmp_path / "base"
    base.mkdir()
    (base / "baseline.json").write_text((root / "base" / "baseline.json").read_text())
    tensors = load_file(str(root / "base" / "outputs.safetensors"))
    tensors["0.frames"] = tensors["0.frames"][:1].repeat(5, 1, 1, 1).contiguous()
    save_file(tensors, str(base / "outputs.safetensors"))
    family = load_family(model)
    report, _, _ = compare_baseline(base, model, family, target=Target(0.0, 0.0, 1.0), gate="target")
    assert report["kind"] == "acceleration" and not report["passed"]
    assert [f for f in report["failures"] if "frame-to-frame" in f and f.startswith("case 0")]
    assert not [f for f in report["failures"] if f.startswith("case 1")]  # case 1 kept its consistency


# ---- configurations -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def flux(tiny_model_dir, tmp_path_factory):
    model, root = tiny_model_dir("flux"), tmp_path_factory.mktemp("flux-baseline")
    assert cli.main(["quality", "--model", model, "--save-baseline", str(root / "base")]) == 0
    return model, root


def test_bf16_fails_the_exact_gate_and_passes_the_target_when_asked(flux):
    model, root = flux
    code, report, _ = _compare(model, root, "bf16", "--dtype", "bfloat16")
    assert code == 1 and report["kind"] == "exact" and report["summary"]["max_abs"] > 0.01  # measured 0.053
    assert report["current"]["configuration"]["dtype"] == "torch.bfloat16"
    code, report, _ = _compare(model, root, "bf16-target", "--dtype", "bfloat16", "--gate", "target")
    assert code == 0 and report["kind"] == "acceleration" and report["summary"]["psnr_min"] >= 30  # measured 42.9


def test_served_batches_the_cases_within_the_rounding_tolerance(flux):
    model, root = flux
    code, report, _ = _compare(model, root, "served", "--served", "4")
    conf = report["current"]["configuration"]
    assert code == 0 and report["kind"] == "served" and conf["served"] and conf["batch"] == 4
    assert report["gates"]["exact_tolerance"] == SERVED_TOLERANCE
    assert 0 < report["summary"]["max_abs"] <= SERVED_TOLERANCE  # batched: rounding moved (measured 3.0e-6)
    code, _, _ = _compare(model, root, "served-exact", "--served", "4", "--exact-tolerance", "0")
    assert code == 1  # the same run under an exact gate


def test_ulysses_2_runs_on_spawned_ranks_within_the_parallel_tolerance(flux):
    model, root = flux
    code, report, _ = _compare(model, root, "ulysses", "--ulysses", "2")
    assert code == 0 and report["kind"] == "parallel"
    assert report["current"]["configuration"]["parallel"]["ulysses"] == 2
    assert 0 < report["summary"]["max_abs"] <= PARALLEL_TOLERANCE  # measured 2.4e-6


def test_one_change_at_a_time_and_no_configuration_on_a_baseline(flux, tmp_path):
    with pytest.raises(InvalidParam, match="one change at a time"):
        Configuration(0.1, 0.1, served_batch=2)
    model, _ = flux
    assert cli.main(["quality", "--model", model, "--save-baseline", str(tmp_path / "b"), "--served", "2"]) == 2
