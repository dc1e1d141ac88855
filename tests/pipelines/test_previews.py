"""Previews (``partial_images``) read the predicted clean latents of a step and change nothing:
the final image with previews equals the one without, bit for bit, for every family; the
prediction is the right one (at the last step of a flow-matching Euler schedule it is the result)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from triptych.engine.runner import run_request
from triptych.families.base import GenerationParams
from triptych.families.registry import load_family

CASES = {
    "flux": GenerationParams("a red cube", height=32, width=48, steps=4, seed=3),
    "qwen-image": GenerationParams("a red cube", height=32, width=48, steps=4, seed=3),
    "wan-t2v": GenerationParams("a boat", height=32, width=32, frames=5, steps=4, seed=3),
    "qwen-image-edit": GenerationParams(
        "make it blue", height=32, width=32, steps=4, seed=3, image=Image.new("RGB", (32, 32), (200, 30, 30))
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_previews_leave_the_result_unchanged(tiny_model_dir, name):
    family = load_family(tiny_model_dir(name))
    params = CASES[name]
    plain, _ = run_request(family, params)
    got = []
    previewed, _ = run_request(family, params, previews=3, on_preview=lambda i, frames: got.append((i, frames)))
    np.testing.assert_array_equal(previewed.array, plain.array)
    assert [i for i, _ in got] == [0, 1, 2]
    assert all(f.array.shape == plain.array.shape for _, f in got)
    assert not np.array_equal(got[0][1].array, plain.array)


@pytest.mark.parametrize("name", ["flux", "qwen-image"])
def test_the_last_steps_prediction_is_the_result(tiny_model_dir, name):
    family = load_family(tiny_model_dir(name))
    params = family.resolve(CASES[name])
    state = family.prepare("r", params, family.encode(params))
    state.preview_steps = frozenset({state.total_steps})
    while not state.done:
        family.denoise_step([state])
    torch.testing.assert_close(state.x0, state.latents, rtol=0, atol=1e-6)
