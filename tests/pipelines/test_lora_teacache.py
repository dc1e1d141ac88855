"""LoRA with TeaCache on the default model and its shipped adapters (``invert``, ``resize``):
TeaCache's piecewise forward applies each row's adapters in every piece (embedding, the blocks it
computes, the head), so

- with a threshold so small that no row skips, a mixed batch (invert, resize, none) gives the
  latents of the same batch without TeaCache (the piecewise forward is the plain one, adapters
  included; measured 0 max abs), and
- at threshold 0.2 rows skip (the decisions come from the base model's profile, fed the adapted
  trajectory) and each image stays near its uncached image with its adapter's effect present.

Before the adapters were applied in TeaCache's pieces, an adapted row came out as the base model's
image (PSNR 0.1 dB against its uncached image with ``invert``, effect absent): both tests fail then.
Quality figures for more prompts and thresholds: benchmarks/RESULTS.md ("LoRA with TeaCache").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from shapeworld import caption, read_scene, sample_scenes
from shapeworld.styles import STYLES, effect_present
from triptych.calibration.metrics import psnr
from triptych.engine import DenoiserEngine, EngineConfig
from triptych.engine.teacache import make_teacache
from triptych.families.base import GenerationParams
from triptych.families.registry import load_family
from triptych.lora.config import LoraConfig

MODEL = Path(__file__).resolve().parents[2] / "triptych" / "assets" / "default"
EXACT_TOLERANCE = 1e-5  # measured 0 (the pieces are the forward's own calls)
MIN_PSNR_DB = 30.0  # measured (2 prompts, 0.2): invert 43.4 / resize 36.4 / none 31.5 dB min
SPECS = {"invert": (("invert", 1.0),), "resize": (("resize", 1.0),), "none": ()}


@pytest.fixture(scope="module")
def family():
    torch.set_num_threads(1)
    fam = load_family(MODEL)
    fam.enable_lora(LoraConfig(lora=tuple(f"{s}={MODEL}/lora/{s}" for s in STYLES)))
    return fam


@pytest.fixture(scope="module")
def scenes():
    return sample_scenes(len(SPECS), "lora-eval", "heldout")


def run(family, scenes, threshold: float):
    engine = DenoiserEngine(family, EngineConfig(fuse_cfg=True), accel=make_teacache(family))
    for i, (rid, spec) in enumerate(SPECS.items()):
        p = family.resolve(GenerationParams(caption(scenes[i], "long"), seed=i, teacache_threshold=threshold))
        engine.add(family.prepare(rid, p.replace(lora=spec), family.encode(p)))
    with torch.no_grad():
        latents = {s.request_id: s.latents for s in engine.run_until_done()}
    return latents, engine


def pixels(family, latents) -> np.ndarray:
    p = family.resolve(GenerationParams("x"))
    return family.decode(latents, p).array[0]


def test_a_threshold_that_skips_nothing_gives_the_uncached_latents(family, scenes):
    plain, _ = run(family, scenes, 0.0)
    cached, engine = run(family, scenes, 1e-9)
    assert engine.accel.stats.rows_skipped == 0 and engine.accel.stats.rows_computed > 0
    worst = max(float((cached[k] - plain[k]).abs().max()) for k in SPECS)
    assert worst <= EXACT_TOLERANCE, worst


def test_at_threshold_0_2_rows_skip_and_each_adapter_keeps_its_effect(family, scenes):
    plain, _ = run(family, scenes, 0.0)
    cached, engine = run(family, scenes, 0.2)
    assert engine.accel.stats.rows_skipped > 0
    for i, (rid, spec) in enumerate(SPECS.items()):
        a, b = pixels(family, cached[rid]), pixels(family, plain[rid])
        assert psnr(a, b) >= MIN_PSNR_DB, (rid, psnr(a, b))
        if spec:
            image = (np.clip(a, 0, 1) * 255).round().astype(np.uint8)
            assert effect_present(read_scene(image), scenes[i], rid), rid
