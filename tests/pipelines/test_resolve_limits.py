"""Rules the head checks before any worker sees a request (weightless families): an edit image whose
aspect ratio the model's condition resize would round to nothing, and a video past its model's RoPE
range. Both used to be accepted and fail in a worker (a 502, and a denoiser eviction)."""

from __future__ import annotations

import pytest
from PIL import Image

from triptych.core.errors import InvalidParam
from triptych.families.base import GenerationParams
from triptych.families.registry import load_family


@pytest.fixture(scope="module")
def edit():
    """The packaged default edit model: its condition area is 64x64, where the review's 502s came from."""
    from triptych.families.models import PACKAGED_DEFAULT

    return load_family(PACKAGED_DEFAULT.parent / "default_edit", roles=())


@pytest.fixture(scope="module")
def wan(tiny_model_dir):
    return load_family(tiny_model_dir("wan-t2v"), roles=())


@pytest.mark.parametrize("size", [(1, 64), (16, 4096), (4096, 8)])
def test_an_extreme_edit_image_is_refused_naming_its_size(edit, size):
    params = GenerationParams("make it red", image=Image.new("RGB", size), height=64, width=64)
    with pytest.raises(InvalidParam) as e:
        edit.resolve(params)
    assert e.value.field == "image" and e.value.value == f"{size[0]}x{size[1]}" and "aspect ratio" in e.value.rule


def test_an_ordinary_edit_image_passes(edit):
    assert edit.resolve(GenerationParams("make it red", image=Image.new("RGB", (48, 32)), height=64, width=64))


def test_video_past_the_rope_range_is_refused_and_the_last_length_inside_passes(wan):
    assert wan.rope_max_seq_len == 32  # the tiny Wan's config (real checkpoints: 1024)
    ok = GenerationParams("a ball", height=32, width=32, steps=2)
    assert wan.resolve(ok.replace(frames=125))  # (125 - 1) / 4 + 1 = 32 latent frames
    assert wan.resolve(ok.replace(frames=1, width=512))  # 512 / 16 = 32 patches
    with pytest.raises(InvalidParam) as e:
        wan.resolve(ok.replace(frames=129))
    assert e.value.field == "frames" and "at most 125" in e.value.rule
    with pytest.raises(InvalidParam) as e:
        wan.resolve(ok.replace(frames=1, height=16, width=528))
    assert e.value.field == "width" and "at most 512" in e.value.rule
