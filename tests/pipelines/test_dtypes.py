"""bfloat16 on CPU for every family: staged equals diffusers' own pipeline in bf16 exactly, and the bf16
image stays within a stated PSNR of the float32 one.

Measured on the tiny seeded models (torch 2.13 CPU, one thread), staged bf16 vs staged float32:
FLUX 43.0 dB, Qwen-Image 49.6, Qwen-Image-Edit 49.9, Wan T2V 46.8, Wan I2V 38.9. Each bound is the
measured figure minus 6 dB (4x the measured MSE).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit
from PIL import Image

from triptych.calibration.metrics import psnr
from triptych.engine.runner import run_request
from triptych.families.base import GenerationParams
from triptych.families.registry import load_family

MIN_PSNR_DB = {
    "flux": 37.0,  # measured 43.0
    "qwen-image": 43.5,  # measured 49.6
    "qwen-image-edit": 43.5,  # measured 49.9
    "wan-t2v": 40.5,  # measured 46.8
    "wan-i2v": 32.5,  # measured 38.9
}
CONDITION_AREA = 48 * 48  # the edit pipeline's hard-coded ~1 MP condition image, shrunk for speed
ORIGINAL_CALCULATE_DIMENSIONS = pipeline_qwenimage_edit.calculate_dimensions


@pytest.fixture(scope="module", autouse=True)
def small_condition_and_one_thread():
    """One thread: the shared 2-core machine (results do not depend on it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    small = lambda area, ratio: ORIGINAL_CALCULATE_DIMENSIONS(CONDITION_AREA, ratio)  # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline_qwenimage_edit, "calculate_dimensions", small)
        yield
    torch.set_num_threads(threads)


def _params(name: str) -> GenerationParams:
    kw = dict(prompt="a red circle on a blue background", seed=3, steps=2)
    if name in ("qwen-image-edit", "wan-i2v"):
        kw["image"] = Image.fromarray((np.random.RandomState(7).rand(40, 48, 3) * 255).astype("uint8"))
    if name.startswith("wan"):
        kw.update(height=32, width=32, frames=5, guidance=3.0)
    return GenerationParams(**kw)


def _dtypes_off_the_fp32_list(model) -> set[torch.dtype]:
    """Parameter dtypes outside the modules diffusers keeps in float32 on purpose (Wan's time embedder
    and norms: ``_keep_in_fp32_modules``)."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    return {p.dtype for n, p in model.named_parameters() if not any(k in n.split(".") for k in keep)}


@pytest.mark.parametrize("name", sorted(MIN_PSNR_DB))
def test_bfloat16_runs_exactly_as_diffusers_and_close_to_float32(tiny_model_dir, name):
    images = {}
    for dtype in ("float32", "bfloat16"):
        family = load_family(tiny_model_dir(name), dtype=dtype)
        assert family.dtype is getattr(torch, dtype)
        assert _dtypes_off_the_fp32_list(family.pipe.transformer) == {family.dtype}
        params = family.resolve(_params(name))
        frames, _ = run_request(family, params, fuse_cfg=False)
        reference = np.asarray(family.reference_call(params), dtype=np.float32).reshape(frames.array.shape)
        assert np.abs(frames.array - reference).max() == 0.0, dtype  # the stage split is exact in bf16 as well
        images[dtype] = frames.array
    assert psnr(images["bfloat16"], images["float32"]) >= MIN_PSNR_DB[name]
