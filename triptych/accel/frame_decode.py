"""One frame through a causal-3D VAE decoder as 2D convolutions (``--compile`` on image families).

Qwen-Image's VAE (``AutoencoderKLQwenImage``, Wan's architecture) decodes an image as one frame of a
video: every ``QwenImageCausalConv3d`` pads its input with ``kernel_t - 1`` zero frames in front
(``_padding``; the first chunk has no cached frames), so for a one-frame input only the kernel's last
temporal tap ever meets a real value, and the convolution equals a 2D convolution of that frame with
``weight[:, :, -1]``. The temporal upsampler's ``time_conv`` never runs on a first chunk (diffusers
marks it ``"Rep"``), and without a feature cache it does not run either. So the decoder called on the
one frame with ``feat_cache=None`` and its causal convolutions replaced by ``FrameConv`` computes
``vae.decode``'s sum without its zero terms: a third of the 3x3x3 convolutions' multiply-adds, and at
small sizes oneDNN's 2D kernels instead of ATen's unfolding ``slow_conv3d``. The sums run in another
order, so it is not bit-identical to ``vae.decode`` (max abs over the sample in [-1, 1] on the
default model: 1.2e-6 for a request's latents, 1.2e-5 for standard-normal ones;
tests/pipelines/test_frame_decode.py); eager decoding keeps diffusers' decode, and
``--compile`` compiles this one (docs/speed.md).

``frame_decoder`` builds it as a structural copy of ``vae.decoder`` that shares its parameters (no
weight is copied); the VAE itself, its encoder and its multi-frame decode are untouched.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F


def _causal(m: torch.nn.Module) -> bool:
    """A causal conv3d of diffusers' Wan/Qwen-Image VAEs whose one-frame output is its last tap's 2D conv."""
    if not isinstance(m, torch.nn.Conv3d) or not type(m).__name__.endswith("CausalConv3d"):
        return False
    pad = getattr(m, "_padding", None)
    return (
        pad is not None
        and len(pad) == 6
        and pad[4] == m.kernel_size[0] - 1
        and pad[5] == 0
        and m.stride == (1, 1, 1)
        and m.dilation == (1, 1, 1)
        and m.groups == 1
        and m.padding == (0, 0, 0)
    )


class FrameConv(torch.nn.Module):
    """A ``_causal`` conv3d on one frame without a cache: the 2D conv of its last temporal tap."""

    def __init__(self, conv: torch.nn.Conv3d):
        super().__init__()
        self.conv = conv  # shared, not copied: its weight is read at each call
        self.spatial = (conv._padding[2], conv._padding[0])  # (height, width) zero padding

    def forward(self, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        if cache_x is not None or x.shape[2] != 1:
            raise ValueError("FrameConv runs one frame without a feature cache")
        w = self.conv.weight[:, :, -1]
        return F.conv2d(x[:, :, 0], w, self.conv.bias, padding=self.spatial).unsqueeze(2)


class FrameDecoder(torch.nn.Module):
    """``vae.decode(z)``'s sample for latents ``z`` of one frame, (B, z_dim, 1, h, w) -> (B, 3, 1, H, W)."""

    def __init__(self, post_quant_conv: torch.nn.Module, decoder: torch.nn.Module):
        super().__init__()
        self.post_quant_conv, self.decoder = post_quant_conv, decoder

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.clamp(self.decoder(self.post_quant_conv(z)), min=-1.0, max=1.0)


def frame_decoder(vae: torch.nn.Module) -> FrameDecoder | None:
    """A ``FrameDecoder`` sharing ``vae``'s weights, or None when ``vae`` is not a causal-3D VAE whose
    every decoder convolution is ``_causal`` (then it has no one-frame shortcut here)."""
    decoder, post = getattr(vae, "decoder", None), getattr(vae, "post_quant_conv", None)
    if not isinstance(decoder, torch.nn.Module) or not isinstance(post, torch.nn.Module):
        return None
    convs = [m for m in decoder.modules() if isinstance(m, torch.nn.Conv3d)]
    if not convs or not all(_causal(m) for m in [*convs, post]):
        return None
    shared = {id(t): t for t in [*vae.parameters(), *vae.buffers()]}
    clone = copy.deepcopy(decoder, shared)  # new module objects, the same parameter tensors
    for module in list(clone.modules()):
        for name, child in list(module.named_children()):
            if _causal(child):
                setattr(module, name, FrameConv(child))
    return FrameDecoder(FrameConv(post), clone)


def decodes_frame(vae: torch.nn.Module, z: torch.Tensor) -> bool:
    """Whether a ``FrameDecoder`` gives ``vae.decode(z)`` for these latents: one frame, no tiling."""
    return z.dim() == 5 and z.shape[2] == 1 and not getattr(vae, "use_tiling", False)
