"""Two style variants of the shape world, the LoRA adapters' targets, and their readout.

A style maps the scene a prompt describes to the scene drawn (``style_scene``):

* ``invert``: a changed palette; every colour, shape and background, is drawn as its RGB complement
  (red as cyan, white as black, ...), so "a red circle on white" comes out a cyan circle on black;
* ``resize``: the shape drawn at the other size (a "large" prompt gives a small shape and back).

Both are drawn inside the world's own vocabulary, on purpose: the default model's VAE decodes only
this world's flat renders. Measured while choosing these, on 80 scenes through its encode/decode:
thick-outline renders came back with no outline read (0/80) and 18% with every attribute right;
renders at 70% brightness came back above 85% (0/80 still dark). An adapter on the
transformer alone could not draw such styles. The consequence:
a styled image is a plain scene, and whether the style is present is read against the prompt
(:func:`effect_present`), not from the image alone.  Neither style has a fixed point (no colour is
its own complement, no size its own swap), so the effect is visible on every prompt.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from PIL import Image

from shapeworld.scene import COLORS, PartialScene, Scene

STYLES: tuple[str, ...] = ("invert", "resize")
#: The attributes each style changes (the rest must stay as the prompt says).
CHANGED: dict[str, tuple[str, ...]] = {"invert": ("color", "background"), "resize": ("size",)}
_BY_RGB = {rgb: name for name, rgb in COLORS.items()}


def complement(color: str) -> str:
    """The named colour whose RGB is ``255 - rgb`` (every named colour has one, never itself)."""
    r, g, b = COLORS[color]
    return _BY_RGB[(255 - r, 255 - g, 255 - b)]


def style_scene(scene: Scene, style: str | None) -> Scene:
    """The scene drawn for a prompt describing ``scene`` in ``style`` (``None``: ``scene``)."""
    if style is None:
        return scene
    if style == "invert":
        return dataclasses.replace(scene, color=complement(scene.color), background=complement(scene.background))
    if style == "resize":
        return dataclasses.replace(scene, size="small" if scene.size == "large" else "large")
    raise ValueError(f"unknown style {style!r}; expected one of {STYLES}")


def render_styled(scene: Scene, style: str | None, size: int = 64, supersample: int = 4) -> Image.Image:
    """``render(style_scene(scene, style))``: deterministic like :func:`shapeworld.render`."""
    from shapeworld.render import render

    return render(style_scene(scene, style), size, supersample)


def effect_present(readout: PartialScene, scene: Scene, style: str) -> bool:
    """Whether an image read as ``readout`` for a prompt describing ``scene`` shows ``style``: every
    attribute the style changes reads as the styled value (never the prompt's: no style has a
    fixed point)."""
    target = style_scene(scene, style)
    return all(getattr(readout, a) == getattr(target, a) for a in CHANGED[style])


def read_effect(image: Image.Image | np.ndarray, scene: Scene, style: str) -> bool:
    """:func:`effect_present` on the scorer's readout of ``image``."""
    from shapeworld.scorer import read_scene

    return effect_present(read_scene(image), scene, style)
