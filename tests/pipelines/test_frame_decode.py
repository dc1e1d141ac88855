"""The one-frame decoder (``accel/frame_decode.py``) against diffusers' own ``vae.decode``.

The reference is a VAE loaded afresh (or built from the same seed) and never touched: the frame
decoder is built from another instance with the same weights. Measured (torch 2.13 CPU, one thread),
max abs over the decoded sample in [-1, 1] for standard-normal latents: the default model's VAE
1.2e-5 (its images saturate; on a denoised request's latents 1.2e-6), a seeded VAE with temporal
upsampling in its config 1.2e-6. The sums of the 2D convolutions run in another order than the 3D
ones (the zero frames' products are left out); each tolerance is 10x its figure.
"""

from __future__ import annotations

import pytest
import torch

from triptych.accel.frame_decode import FrameConv, decodes_frame, frame_decoder
from triptych.families.models import default_model_dir

TOLERANCE = {"default": 1.2e-4, "seeded": 1.2e-5}  # measured 1.2e-5 / 1.2e-6


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _seeded_vae():
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(11)
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, True]
    )
    for p in vae.parameters():  # away from the zero-initialised gammas/biases: every term matters
        p.data.add_(torch.randn_like(p) * 0.05)
    return vae.eval()


def _pair(make):
    """(reference VAE, VAE the frame decoder is built on): two instances with the same weights."""
    ref, mine = make(), make()
    mine.load_state_dict(ref.state_dict())
    return ref, mine


CASES = {
    "default": lambda: __import__("diffusers").AutoencoderKLQwenImage.from_pretrained(
        str(default_model_dir() / "vae"), torch_dtype=torch.float32
    ),
    "seeded": _seeded_vae,
}


@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_one_frame_equals_vae_decode(case):
    ref, mine = _pair(CASES[case])
    frame = frame_decoder(mine)
    assert frame is not None
    gen = torch.Generator().manual_seed(3)
    for h, w in ((8, 8), (6, 10)):
        z = torch.randn(2, ref.config.z_dim, 1, h, w, generator=gen)
        want = ref.decode(z, return_dict=False)[0]
        got = frame(z)
        diff = float((got - want).abs().max())
        print(f"{case} {h}x{w}: max abs {diff:.2e} (image range {float(want.min()):.2f}..{float(want.max()):.2f})")
        assert got.shape == want.shape
        assert diff <= TOLERANCE[case]


def test_shares_weights_and_leaves_the_vae_alone():
    vae = _seeded_vae()
    before = {n: type(m) for n, m in vae.named_modules()}
    frame = frame_decoder(vae)
    assert {n: type(m) for n, m in vae.named_modules()} == before  # the VAE's own decoder is untouched
    ptrs = {p.data_ptr() for p in vae.parameters()}
    assert {p.data_ptr() for p in frame.parameters()} <= ptrs  # no weight copied
    convs = [m for m in frame.modules() if isinstance(m, FrameConv)]
    assert len(convs) == sum(type(m).__name__.endswith("CausalConv3d") for m in vae.decoder.modules()) + 1


def test_refuses_what_it_cannot_decode():
    from diffusers import AutoencoderKL

    vae = _seeded_vae()
    assert frame_decoder(AutoencoderKL(block_out_channels=(8,), norm_num_groups=4)) is None  # 2D VAE
    assert decodes_frame(vae, torch.zeros(1, 4, 1, 8, 8))
    assert not decodes_frame(vae, torch.zeros(1, 4, 3, 8, 8))  # a video: diffusers' chunked decode
    vae.enable_tiling()
    assert not decodes_frame(vae, torch.zeros(1, 4, 1, 8, 8))  # tiling: diffusers' tiled decode
    conv = frame_decoder(_seeded_vae()).decoder.conv_in
    with pytest.raises(ValueError, match="one frame"):
        conv(torch.zeros(1, 4, 2, 8, 8))
