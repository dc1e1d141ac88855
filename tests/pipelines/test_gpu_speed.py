"""``--compile`` and ``--quantize`` on CUDA (skipped without a GPU; run by benchmarks/gpu_check.sh): the
default model compiled on the device against eager on the device, fp8 and int8 against bf16/fp32,
fp8 refused on a device without fp8 matmuls. The bounds are the CPU figures' (tests/pipelines/
test_compile.py, test_quantize.py) loosened for the device's kernels; the run prints the measured
figures. Measured on one H200 (torch 2.11+cu130, 2026-12-04, benchmarks/RESULTS.md): int8 weight-only,
int8 dynamic and fp8 passed; compiled vs eager gave max abs 9.3e-4 with cuDNN's default TF32
convolutions (eager decodes with diffusers' conv3d, ``--compile`` with the one-frame decoder's conv2d:
two TF32 roundings), above the bound. The compile test now runs the convolutions in float32; that
figure is not measured yet (its rerun ran past the check's 240 s cap, compiling cold).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from triptych.accel import SpeedConfig
from triptych.accel.apply import FP8_CAPABILITY
from triptych.calibration.metrics import psnr
from triptych.engine.runner import run_request
from triptych.engine.warmup import warm_up
from triptych.families.base import GenerationParams
from triptych.families.models import default_model_dir
from triptych.families.registry import load_family

pytestmark = pytest.mark.gpu

COMPILE_TOLERANCE = 1e-4  # float32 on the device (not measured yet, see above); CPU measured 4.2e-6
# H200 measured 45.6 / 46.5 / 39.2 dB (int8 weight-only / dynamic / fp8 vs bf16); CPU int8 vs fp32: 54.9 / 42.4
MIN_PSNR_DB = {"int8-weight-only": 40.0, "int8-dynamic": 30.0, "fp8": 30.0}


def _image(family, seed=0):
    params = family.resolve(GenerationParams(prompt="a red circle on a blue background", seed=seed))
    return run_request(family, params)[0].array


@pytest.fixture
def float32_convolutions():
    """cuDNN convolutions in float32, not TF32 (``torch.backends.cudnn.allow_tf32`` is True by default)."""
    previous = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = previous


def test_compiled_on_cuda_matches_eager(tmp_path, float32_convolutions):
    eager = load_family(default_model_dir(), device="cuda", dtype="float32")
    compiled = load_family(
        default_model_dir(), device="cuda", dtype="float32", speed=SpeedConfig(compile=True, compile_cache_dir=tmp_path)
    )
    warm_up(compiled)
    diff = float(np.abs(_image(compiled) - _image(eager)).max())
    print(f"cuda compiled vs eager float32: max abs {diff:.2e}")
    assert diff <= COMPILE_TOLERANCE


def test_cuda_graphs_replay_the_compiled_stack_and_match_eager(tmp_path, float32_convolutions):
    """``--cuda-graphs``: the compiled block stack replays as CUDA graphs (inductor's CUDA graph trees
    recorded some: their manager for the device exists, nothing was skipped), and images of two
    prompts of different lengths (two recorded shapes each: one row in the warm-up, two per fused
    step) match eager float32 on the device within the compile bound. Not yet run on a device."""
    from torch._dynamo.utils import counters
    from torch._inductor.cudagraph_trees import get_manager

    eager = load_family(default_model_dir(), device="cuda", dtype="float32")
    speed = SpeedConfig(compile=True, cuda_graphs=True, compile_cache_dir=tmp_path)
    graphed = load_family(default_model_dir(), device="cuda", dtype="float32", speed=speed)
    warm_up(graphed)
    for seed, prompt in enumerate(["a red circle on a blue background", "a green square"]):
        params = graphed.resolve(GenerationParams(prompt=prompt, seed=seed))
        got, want = run_request(graphed, params)[0].array, run_request(eager, params)[0].array
        diff = float(np.abs(got - want).max())
        print(f"cuda graphs vs eager float32 ({prompt!r}): max abs {diff:.2e}")
        assert diff <= COMPILE_TOLERANCE
    device = torch.device("cuda").index or torch.cuda.current_device()
    assert get_manager(device, create_if_none_exists=False) is not None
    assert counters["inductor"]["cudagraph_skips"] == 0


@pytest.mark.parametrize("mode", sorted(MIN_PSNR_DB))
def test_quantized_on_cuda_within_psnr(mode):
    pytest.importorskip("torchao")
    if mode == "fp8" and torch.cuda.get_device_capability() < FP8_CAPABILITY:
        pytest.skip(f"fp8 needs compute capability >= {FP8_CAPABILITY}")
    reference = _image(load_family(default_model_dir(), device="cuda", dtype="bfloat16"))
    family = load_family(
        default_model_dir(), device="cuda", dtype="bfloat16", speed=SpeedConfig(quantize=(f"transformer={mode}",))
    )
    figure = psnr(_image(family), reference)
    print(f"cuda transformer={mode} vs bf16: PSNR {figure:.1f} dB")
    assert figure >= MIN_PSNR_DB[mode]
