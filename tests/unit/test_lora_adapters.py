"""The shipped style adapters, loaded through a pristine diffusers pipeline, show their effect.

Four held-out prompts per adapter at the shipped settings (20 steps, true CFG 4), once with the
adapter and once with LoRA disabled.  The bounds are from ``evaluate_lora`` on 40 prompts
(benchmarks/RESULTS.md, "Shipped LoRA adapters"): the effect on 40/40 prompts with each adapter and
0/40 without, these four included (4/4 and 0/4). The prompts and seeds are fixed, so the check is
deterministic; >= 3 of 4 with leaves room for numeric drift on another CPU, and an adapter that does
nothing (checked by disabling it) reads 0/4 with, one left on reads 4/4 without.
"""

import pytest
import torch

from shapeworld import caption, read_scene, sample_scenes
from shapeworld.styles import STYLES, effect_present
from training.evaluate_lora import DEFAULT_MODEL, generate, load

N = 4


@pytest.fixture(scope="module")
def pipe():
    torch.set_num_threads(1)
    return load(DEFAULT_MODEL)


def test_every_style_ships_an_adapter():
    for style in STYLES:
        assert (DEFAULT_MODEL / "lora" / style / "pytorch_lora_weights.safetensors").is_file()
        assert (DEFAULT_MODEL / "lora" / style / "README.md").is_file()


@pytest.mark.parametrize("style", STYLES)
def test_adapter_effect_present_with_and_absent_without(pipe, style):
    scenes = sample_scenes(N, "lora-eval", "heldout")
    prompts = [caption(s, "long") for s in scenes]
    counts = {}
    for label, active in (("with", style), ("without", None)):
        images = generate(pipe, prompts, list(range(N)), active)
        counts[label] = sum(effect_present(read_scene(im), s, style) for im, s in zip(images, scenes))
    assert counts["with"] >= 3, f"{style}: effect on {counts['with']}/{N} prompts with the adapter"
    assert counts["without"] == 0, f"{style}: effect on {counts['without']}/{N} prompts without it"
