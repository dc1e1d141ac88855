"""The shipped shape-world video model (triptych/assets/video, WanPipeline), offline.

It loads with diffusers' own ``WanPipeline.from_pretrained`` and with the family adapter; Triptych's
generation equals the pristine pipeline bit for bit; its VAE decodes each frame exactly as the
default image VAE does; and a few held-out prompts come out right when read back from pixels. The
last is a regression check on the shipped weights (evaluate's first prompts and seeds); the
50-video figures come from ``python -m triptych.training.evaluate_video`` (MODEL_CARD.md).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.helpers import pristine_pipeline, seeded
from triptych.models import PACKAGED_DEFAULT, PACKAGED_VIDEO, default_video_model_dir

pytestmark = pytest.mark.skipif(
    not (PACKAGED_VIDEO / "model_index.json").is_file(), reason="no trained video model shipped"
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def family():
    from triptych.pipelines.registry import load_family

    return load_family(PACKAGED_VIDEO)


@pytest.fixture(scope="module")
def pristine():
    return pristine_pipeline(PACKAGED_VIDEO)


def test_loads_offline_with_pristine_diffusers_and_the_family(monkeypatch, pristine, family):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    from triptych.pipelines.registry import architecture

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pipe = WanPipeline.from_pretrained(PACKAGED_VIDEO)
    assert isinstance(pipe.vae, AutoencoderKLWan) and isinstance(pipe.transformer, WanTransformer3DModel)
    assert isinstance(pipe.text_encoder, UMT5EncoderModel) and isinstance(pipe.scheduler, UniPCMultistepScheduler)
    assert pipe.vae.config.temperal_downsample == [False, False, False] and pipe.vae_scale_factor_temporal == 1
    assert type(pristine) is WanPipeline
    assert architecture(PACKAGED_VIDEO) == "WanPipeline" and default_video_model_dir() == PACKAGED_VIDEO
    assert family.name == "wan-t2v"
    settings = json.loads((PACKAGED_VIDEO / "triptych.json").read_text())
    assert family.defaults == {k: settings[k] for k in ("height", "width", "frames", "steps", "guidance")}
    assert family.max_sequence_length == settings["max_sequence_length"] and settings["world"] == "shapes-video"
    assert (PACKAGED_VIDEO / "MODEL_CARD.md").is_file() and (PACKAGED_VIDEO / "gallery.png").is_file()


def test_video_vae_decodes_each_frame_as_the_image_vae(pristine):
    """The image VAE's weights with the taps on past frames zeroed: each frame decodes alone.
    Measured max abs difference 0.0 (with the past taps left in: 2.0, the whole output range)."""
    from diffusers import AutoencoderKLQwenImage

    image_vae = AutoencoderKLQwenImage.from_pretrained(PACKAGED_DEFAULT / "vae").eval()
    z = torch.randn(1, 16, 3, 8, 8, generator=seeded(0))
    with torch.no_grad():
        video = pristine.vae.decode(z).sample
        frames = torch.cat([image_vae.decode(z[:, :, i : i + 1]).sample for i in range(3)], dim=2)
    assert video.shape == frames.shape == (1, 3, 3, 64, 64)
    assert (video - frames).abs().max().item() == 0.0
    assert pristine.vae.config.latents_mean == image_vae.config.latents_mean


def test_generate_is_bit_identical_to_the_pristine_pipeline(family, pristine):
    from triptych.pipelines.base import GenerationParams
    from triptych.pipelines.runner import run_request

    params = family.resolve(GenerationParams(prompt="a red circle moving rightwards on a blue background", seed=3))
    frames, _ = run_request(family, params, fuse_cfg=False)
    # NOTE: WanPipeline adds a frame to every count when the VAE does not compress time (family.py).
    ref = pristine(
        prompt=params.prompt,
        height=params.height,
        width=params.width,
        num_frames=params.frames - 1,
        num_inference_steps=params.steps,
        guidance_scale=params.guidance,
        generator=seeded(params.seed),
        max_sequence_length=family.max_sequence_length,
        output_type="np",
    ).frames[0]
    assert frames.array.shape == ref.shape == (9, 64, 64, 3)
    assert np.abs(frames.array - ref).max() == 0.0


HELDOUT = 4  # evaluate_video's first 4 held-out prompts and seeds
COLOUR_AND_BACKGROUND_AT_LEAST = 3  # measured: 4 of 4 (50 of 50 in the card)
DIRECTION_AT_LEAST = 3  # measured: 4 of 4 (50 of 50 in the card)
# NOTE: the shape kind is not asserted: the shipped model gets it on 24 of 50 (1 of these 4; MODEL_CARD.md).


def test_heldout_prompts_draw_colour_background_and_direction(family):
    from triptych.pipelines.base import GenerationParams
    from triptych.pipelines.runner import run_request
    from triptych.world.video import clip_caption, sample_clips
    from triptych.world.video_scorer import score_clip

    rows = []
    for index, clip in enumerate(sample_clips(50, "eval", "heldout")[:HELDOUT]):
        assert clip.split == "heldout"
        frames, _ = run_request(family, GenerationParams(prompt=clip_caption(clip, "short"), seed=index))
        assert frames.array.shape == (9, 64, 64, 3)
        rows.append(score_clip(frames.to_uint8(), clip))
    right = sum(r["color"] >= 0.8 and r["background"] >= 0.8 for r in rows)
    assert right >= COLOUR_AND_BACKGROUND_AT_LEAST, rows
    assert sum(bool(r["direction"]) for r in rows) >= DIRECTION_AT_LEAST, rows
