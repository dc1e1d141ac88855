"""Placement: the attention backend reaches every attention processor, group-offload hooks change no
result, and a DeviceConfig passes through load_family whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

from triptych.core.devices import DeviceConfig
from triptych.engine.runner import run_request
from triptych.families.base import GenerationParams
from triptych.families.placement import group_offload
from triptych.families.registry import load_family

# _native_math (and flex) vs native on CPU float32, image max abs on the tiny FLUX, 2 steps.
BACKEND_ATOL = 1e-5  # measured 1.6e-6 (two runs)


@pytest.fixture(autouse=True)
def restore_active_backend():
    """set_attention_backend also sets diffusers' process-wide default: put it back for later tests."""
    yield
    _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)


def _processors(transformer):
    return [m.processor for m in transformer.modules() if hasattr(getattr(m, "processor", None), "_attention_backend")]


def _image(family, **kw):
    params = family.resolve(GenerationParams(prompt="a red circle", seed=4, steps=2, **kw))
    return run_request(family, params, fuse_cfg=False)[0].array


# flex compiles its kernel with torch dynamo on first use: minutes on a loaded 2-core CPU, so it runs
# with --run-slow (and on the GPU check).
@pytest.mark.parametrize("backend", ["_native_math", pytest.param("flex", marks=pytest.mark.slow)])
def test_attention_backend_is_set_on_every_processor_and_changes_little(tiny_model_dir, backend):
    native = load_family(tiny_model_dir("flux"))
    other = load_family(tiny_model_dir("flux"), device=DeviceConfig(attention=backend))
    procs = _processors(other.pipe.transformer)
    assert procs and all(p._attention_backend == AttentionBackendName(backend) for p in procs)
    assert all(p._attention_backend == AttentionBackendName.NATIVE for p in _processors(native.pipe.transformer))
    assert np.abs(_image(other) - _image(native)).max() <= BACKEND_ATOL


def test_group_offload_hooks_change_no_result(tiny_model_dir):
    """The group-offload code path (CUDA in production) run with a CPU onload device: same output."""
    plain = load_family(tiny_model_dir("flux"))
    offloaded = load_family(tiny_model_dir("flux"))
    group_offload(offloaded.pipe, torch.device("cpu"))
    assert np.array_equal(_image(offloaded), _image(plain))


def test_load_family_takes_a_whole_device_config(tiny_model_dir):
    config = DeviceConfig(dtype="bfloat16", vae_slicing=True)
    family = load_family(tiny_model_dir("flux"), device=config)
    assert family.device_config is config and family.dtype is torch.bfloat16
    assert family.pipe.vae.use_slicing
    with pytest.raises(AssertionError):
        load_family(tiny_model_dir("flux"), device=config, dtype="float32")
