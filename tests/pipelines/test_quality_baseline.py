"""``triptych quality --save-baseline`` / ``--baseline`` on the packaged default model: the same code
compares exact (exit 0), a damaging configuration fails the gate (exit 1) and its report shows it,
and the HTML report renders in headless Chromium with every image loaded.

The default model's shipped profile computes the first 6 steps and never skips two in a row (at most
35% skipped, within the target on its evaluation requests), so no threshold damages it; the damaging
setting is plain TeaCache (warmup 1, no cap, reuse) at 0.3, from a profile in a copy of the model
(links to its files, its own ``teacache/``): in the calibration sweep it skipped 73% of forwards at
11.9 dB worst PSNR. "10x the recommendation" is tested on a tiny FLUX with a recommendation
(``test_calibrate_sweep.py``)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.extras import chromium, needs_extra
from triptych import cli

CHROMIUM = chromium()
DAMAGING = 0.3


def _plain_teacache_copy(model: Path) -> Path:
    """The default model (linked) with a plain TeaCache profile: warmup 1, no cap, reuse."""
    from triptych.accel.teacache_profile import load_profile, save_profile
    from triptych.families.models import PACKAGED_DEFAULT

    model.mkdir()
    for entry in PACKAGED_DEFAULT.iterdir():
        if entry.name != "teacache":
            (model / entry.name).symlink_to(entry)
    shipped = load_profile(PACKAGED_DEFAULT / "teacache" / "qwen-image-20steps.json")
    plain = dataclasses.replace(shipped, warmup=1, max_skips=None, forecast=0, recommended_threshold=None)
    save_profile(plain, model / "teacache" / "qwen-image-20steps.json")
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("baseline")
    model = _plain_teacache_copy(root / "model")
    matrix = root / "matrix.yaml"
    matrix.write_text("guidance: [4.0]\nseeds: [7]\n")  # 2 held-out prompts x 1 guidance x 1 seed
    base = ["quality", "--model", str(model), "--save-baseline", str(root / "base"), "--matrix", str(matrix)]
    assert cli.main(base) == 0
    return root


def _compare(root: Path, name: str, *extra: str) -> tuple[int, dict, Path]:
    out = root / name
    args = ["quality", "--model", str(root / "model"), "--baseline", str(root / "base"), "--report", str(out)]
    code = cli.main([*args, *extra])
    return code, json.loads((out / "report.json").read_text()), out


def test_a_baseline_records_what_made_it(saved):
    meta = json.loads((saved / "base" / "baseline.json").read_text())
    assert meta["format"] == "triptych.quality.baseline/1" and meta["family"] == "qwen-image"
    assert [c["guidance"] for c in meta["cases"]] == [4.0, 4.0] and {c["seed"] for c in meta["cases"]} == {7}
    assert meta["model"]["revision"] and meta["configuration"]["teacache_threshold"] == 0.0
    assert meta["triptych_version"] and "git_commit" in meta
    assert all(c["adheres"] is not None for c in meta["cases"])


def test_the_same_code_compares_identical_and_exits_0(saved):
    code, report, _ = _compare(saved, "same")
    assert code == 0 and report["passed"] and report["kind"] == "exact"
    assert report["summary"]["identical"] == 2 and report["summary"]["latent_rel_l2_max"] == 0.0


def test_a_damaging_threshold_fails_and_the_report_shows_it(saved):
    damaging = DAMAGING
    code, report, out = _compare(saved, "damaged", "--teacache-threshold", f"{damaging:g}")
    assert code == 1 and not report["passed"] and report["failures"]
    assert report["current"]["configuration"]["teacache_threshold"] == pytest.approx(damaging)
    assert report["summary"]["skipped_fraction"] > 0.5 and report["summary"]["psnr_min"] < 30
    assert "FAIL: worst PSNR" in (out / "report.md").read_text()
    html = (out / "index.html").read_text()
    assert 'class="fail"' in html and "diff_0.png" in html and "Gates FAILED" in html


@needs_extra("chromium")
def test_the_report_renders_in_headless_chromium_with_its_images(saved, tmp_path):
    out = saved / "damaged"
    if not (out / "index.html").exists():
        _compare(saved, "damaged", "--teacache-threshold", str(DAMAGING))
    html = (out / "index.html").read_text()
    sources = re.findall(r'<img[^>]* src="([^"]+)"', html)
    assert len(sources) >= 7  # plot + 2 cases x (baseline, current, diff)
    for src in sources:  # every referenced file exists and decodes
        with Image.open(out / src) as im:
            assert im.size[0] > 0 and im.convert("RGB").getextrema() != ((0, 0), (0, 0), (0, 0))
    probe = out / "probe.html"  # loads the report in a frame and records each image's naturalWidth
    probe.write_text(
        '<html><body><iframe id="r" src="index.html" width="1200" height="900"></iframe><script>'
        "window.onload = () => { const imgs = [...document.getElementById('r').contentDocument.images];"
        "document.body.setAttribute('data-widths', imgs.map(i => i.naturalWidth).join(',')); };"
        "</script></body></html>"
    )
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
        "--allow-file-access-from-files",
        "--virtual-time-budget=5000",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=90)
    widths = re.search(r'data-widths="([^"]*)"', dom.stdout)
    assert widths, dom.stderr[-2000:]
    assert [int(w) > 0 for w in widths.group(1).split(",")] == [True] * len(sources)
    shot = tmp_path / "report.png"
    subprocess.run(
        [CHROMIUM, *flags, f"--screenshot={shot}", "--window-size=1200,1600", (out / "index.html").as_uri()],
        capture_output=True,
        timeout=90,
    )
    pixels = np.asarray(Image.open(shot).convert("RGB"))
    assert pixels.shape[:2] == (1600, 1200) and len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50
