"""What serving executes, in FLOPs: a meta-device count of the loaded family's own code, once per shape,
multiplied by the rows that ran.

- Denoiser (``RowCosts``): a forward over N rows counts N times one row's forward at the batch's
  longest prompt (the family pads shorter prompts to it), traced once per row shape on a meta copy of
  the transformer (``family``'s ``denoise.forward``). LoRA adapters' extra low-rank products are not
  counted.
- Encoder (``EncodeCosts``): each branch's prompt through every text encoder at the token count it
  ran with (``plan.stages.encoder_forward``); an edit's or image-to-video's condition-image work is
  not counted.
- Decoder (``DecodeCosts``): one ``vae.decode`` of the request's size (previews included)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from triptych.core.kinds import Role
from triptych.families.base import Conditioning, DenoiseState, GenerationParams, Row
from triptych.families.geometry import model_defaults
from triptych.plan import components as comp
from triptych.plan import stages
from triptych.plan.inputs import Geometry, forward_of, geometry
from triptych.plan.trace import count, meta_like, meta_module


def _meta(t):
    """A meta copy of a tensor; small integer tensors (shapes read as values) are kept, on the CPU."""
    if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.numel() <= 16:
        return t.cpu()
    return meta_like(t)


def _signature(row: Row) -> tuple:
    s = row.state

    def shapes(d: dict) -> tuple:
        return tuple(
            (k, tuple(v.shape), tuple(v.tolist()) if not v.is_floating_point() and v.numel() <= 16 else ())
            for k, v in sorted(d.items())
            if isinstance(v, torch.Tensor)
        )

    return (tuple(s.latents.shape), shapes(s.cond.branches[row.branch]), shapes(s.cond.shared), shapes(s.aux))


def _size(row: Row) -> int:
    return sum(v.numel() for v in row.state.cond.branches[row.branch].values() if isinstance(v, torch.Tensor))


def model_geometry(family) -> Geometry:
    model_dir = Path(family.model_dir)
    vae = comp.read_config(model_dir / "vae" / "config.json")
    return geometry(family.name, model_dir, vae, model_defaults(model_dir), family.requires_image)


class RowCosts:
    """``per_row(rows)``: FLOPs of one row of a forward over ``rows``; ``cost(rows)``: of the forward."""

    def __init__(self, family) -> None:
        self.family = family
        self._cache: dict[tuple, int] = {}

    @functools.cached_property
    def _meta_transformer(self):
        t = self.family.pipe.transformer  # in the family's dtype: the rows' tensors are in it
        return meta_module(type(t), dict(t.config), self.family.dtype)

    @functools.cached_property
    def _forward(self) -> Callable:
        return forward_of(self.family.name, Geometry(self.family.name, self.family.pipe.vae_scale_factor, 0))

    def per_row(self, rows: Sequence[Row]) -> int:
        row = max(rows, key=_size)
        key = _signature(row)
        if key not in self._cache:
            self._cache[key] = self._trace(row)
        return self._cache[key]

    def cost(self, rows: Sequence[Row]) -> int:
        return self.per_row(rows) * len(rows)

    def _trace(self, row: Row) -> int:
        s = row.state
        cond = Conditioning(
            branches={row.branch: {k: _meta(v) for k, v in s.cond.branches[row.branch].items()}},
            shared={k: _meta(v) for k, v in s.cond.shared.items()},
        )
        timesteps = torch.ones(1, device="meta")
        state = DenoiseState(
            s.request_id, s.params, meta_like(s.latents), None, timesteps, cond, {k: _meta(v) for k, v in s.aux.items()}
        )
        return count(lambda: self._forward(self._meta_transformer, [Row(state, row.branch)])).flops


class EncodeCosts:
    """``cost(cond)``: FLOPs of the text encoders for the branches of an encoded ``Conditioning``."""

    def __init__(self, family) -> None:
        self.family = family
        self._cache: dict[int, int] = {}

    @functools.cached_property
    def _encoders(self) -> list:
        out = []
        for name in self.family.role_components.get(Role.ENCODER, ()):
            module = getattr(self.family.pipe, name, None)
            if module is None or not hasattr(module, "config") or not hasattr(module.config, "model_type"):
                continue  # tokenizers, processors, a VAE (the condition image's encode: not counted)
            if name == "image_encoder":
                continue
            out.append(meta_module(type(module), module.config.to_dict(), torch.bfloat16))
        return out

    @functools.cached_property
    def _geometry(self) -> Geometry:
        return model_geometry(self.family)

    def cost(self, cond: Conditioning) -> int:
        total = 0
        for branch in cond.branches.values():
            embeds = branch.get("prompt_embeds")
            tokens = int(embeds.shape[1]) if embeds is not None else 0
            if tokens not in self._cache:
                g = self._geometry
                self._cache[tokens] = sum(stages.encoder_forward(e, g, tokens).flops for e in self._encoders)
            total += self._cache[tokens]
        return total


class DecodeCosts:
    """``cost(params)``: FLOPs of one ``vae.decode`` of a resolved request's size."""

    def __init__(self, family) -> None:
        self.family = family
        self._cache: dict[tuple, int] = {}

    @functools.cached_property
    def _vae(self):
        vae = self.family.pipe.vae
        return meta_module(type(vae), dict(vae.config), torch.bfloat16)

    def cost(self, params: GenerationParams) -> int:
        key = (params.height, params.width, params.frames or 1)
        if key not in self._cache:
            g = model_geometry(self.family)
            self._cache[key] = stages.vae_decode(self._vae, g, params).flops
        return self._cache[key]
