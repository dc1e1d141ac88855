"""Pieces of the video model's training: colour contrast and the VAE decoder fine-tune's guard."""

from __future__ import annotations

import pytest
import torch

from training.data import contrast


def test_contrast_is_the_mean_squared_colour_difference_of_shape_and_background():
    background, shape = torch.tensor([1.0, -1.0, 1.0]), torch.tensor([1.0, -1.0, -1.0])  # magenta, red
    image = background.view(1, 3, 1, 1).expand(2, 3, 16, 16).clone()
    image[0, :, 4:9, 4:9] = shape.view(3, 1, 1)
    image[1, :, 4:9, 4:9] = -background.view(3, 1, 1)  # green: differs in all three channels
    assert contrast(image).tolist() == pytest.approx([4 / 3, 4.0])
    assert contrast(image.unsqueeze(2)).tolist() == pytest.approx([4 / 3, 4.0])  # the VAE's (B, 3, 1, H, W)


def test_decoder_fine_tune_refuses_a_vae_whose_encoder_moved(tmp_path):
    from diffusers import AutoencoderKLQwenImage

    from training.train_video_vae import train_video_vae
    from training.video_model import IMAGE_VAE

    vae = AutoencoderKLQwenImage.from_pretrained(IMAGE_VAE)
    with torch.no_grad():
        vae.encoder.conv_in.weight.add_(1e-3)
    vae.save_pretrained(tmp_path / "moved")
    with pytest.raises(ValueError, match="encoder is not the image VAE's"):
        train_video_vae(tmp_path / "out", 0, steps=1, init=tmp_path / "moved")
    assert not (tmp_path / "out" / "vae").exists()


def test_redraw_from_the_top_of_the_schedule_is_the_pipelines_own_sampling():
    """The decoder fine-tune's redrawn latents come from the served sampling loop: started at the
    schedule's first step (sigma 1), ``sample_from`` equals a pristine WanPipeline run from the same
    noise (measured 2.9e-6 of latents with mean |x| 0.8)."""
    import json

    from diffusers import WanPipeline

    from training.video_vae_samples import sample_from
    from triptych.families.models import PACKAGED_VIDEO as VIDEO_MODEL

    defaults = json.loads((VIDEO_MODEL / "triptych.json").read_text())
    prompts = [
        "a red circle moving rightwards on a blue background",
        "a white cross moving upwards on a black background",
    ]
    noise = torch.randn(2, 16, defaults["frames"], 8, 8, generator=torch.Generator().manual_seed(3))
    pipe = WanPipeline.from_pretrained(VIDEO_MODEL)
    expected = pipe(
        prompt=prompts,
        negative_prompt=[""] * 2,
        height=defaults["height"],
        width=defaults["width"],
        num_frames=defaults["frames"],
        num_inference_steps=defaults["steps"],
        guidance_scale=defaults["guidance"],
        latents=noise.clone(),
        output_type="latent",
        max_sequence_length=defaults["max_sequence_length"],
    ).frames
    with torch.no_grad():
        got = sample_from(pipe, torch.zeros_like(noise), prompts, defaults, 0, noise)
    assert (got - expected).abs().max().item() < 3e-5
    assert expected.abs().mean().item() > 0.1


def test_shape_loss_with_keep_is_the_loss_of_the_kept_clips_only():
    from training.video_shape_probe import ShapeProbe, shape_loss

    torch.manual_seed(0)
    probe = ShapeProbe(16).eval()
    x = torch.randn(3, 16, 4, 8, 8, requires_grad=True)
    shapes = ["circle", "square", "cross"]
    keep = torch.tensor([True, False, True])
    expected = shape_loss(probe, x[[0, 2]], ["circle", "cross"])
    got = shape_loss(probe, x, shapes, keep)
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)
    assert got.item() != pytest.approx(shape_loss(probe, x, shapes).item(), rel=1e-3)
    got.backward()
    assert x.grad[1].abs().max().item() == 0.0 and x.grad[0].abs().max().item() > 0
    none = shape_loss(probe, x, shapes, torch.zeros(3, dtype=torch.bool))
    assert none.item() == 0.0 and none.requires_grad


def test_set_sampler_rewrites_the_scheduler_and_its_model_index_entry(tmp_path):
    import json
    import shutil

    from diffusers import FlowMatchEulerDiscreteScheduler

    from training.video_model import scheduler, set_sampler
    from triptych.families.models import PACKAGED_VIDEO

    shutil.copy(PACKAGED_VIDEO / "model_index.json", tmp_path / "model_index.json")
    scheduler("unipc").save_pretrained(tmp_path / "scheduler")
    set_sampler(tmp_path, "euler")
    assert json.loads((tmp_path / "model_index.json").read_text())["scheduler"][1] == "FlowMatchEulerDiscreteScheduler"
    euler = FlowMatchEulerDiscreteScheduler.from_pretrained(tmp_path / "scheduler")
    assert euler.config.shift == scheduler("unipc").config.flow_shift == 3.0
    set_sampler(tmp_path, "unipc")
    assert json.loads((tmp_path / "model_index.json").read_text())["scheduler"][1] == "UniPCMultistepScheduler"
    with pytest.raises(ValueError, match="sampler 'heun'"):
        set_sampler(tmp_path, "heun")


def test_redrawn_latents_are_cached_per_model_and_setting(tmp_path, monkeypatch):
    from diffusers import AutoencoderKLQwenImage

    from shapeworld.video import sample_clips
    from training.train_video_vae import clip_frames, encode, redrawn
    from training.video_model import IMAGE_VAE
    from triptych.families.models import PACKAGED_VIDEO

    vae = AutoencoderKLQwenImage.from_pretrained(IMAGE_VAE).eval()
    clips = sample_clips(2, "validation", "train")
    latents = encode(vae, clip_frames(clips))
    first = redrawn(tmp_path, PACKAGED_VIDEO, vae, clips, latents, seed=0, redraws=1)
    assert first.shape == (1, *latents.shape)
    assert 0 < (first[0] - latents).abs().mean() < latents.abs().mean()  # redrawn near, not equal
    import training.video_vae_samples as samples

    real = samples.redraw
    monkeypatch.setattr(samples, "redraw", lambda *a, **k: pytest.fail("redrawn again: the cache was not used"))
    torch.testing.assert_close(redrawn(tmp_path, PACKAGED_VIDEO, vae, clips, latents, 0, 1), first, rtol=0, atol=0)
    monkeypatch.setattr(samples, "redraw", real)
    other = redrawn(tmp_path, PACKAGED_VIDEO, vae, clips, latents, seed=1, redraws=1)  # another seed: redrawn
    assert not torch.equal(other, first)
