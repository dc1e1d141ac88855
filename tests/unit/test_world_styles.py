"""The style variants behind the shipped LoRA adapters and their readout from pixels."""

import pytest

from shapeworld import COLOR_NAMES, Scene, iter_all_scenes, read_scene
from shapeworld.styles import STYLES, complement, read_effect, render_styled, style_scene

SCENES = iter_all_scenes("all")[::11]  # 183 scenes, every shape, colour pair, position and size


def test_complement_is_a_fixed_point_free_involution():
    assert sorted(map(complement, COLOR_NAMES)) == sorted(COLOR_NAMES)
    for c in COLOR_NAMES:
        assert complement(c) != c and complement(complement(c)) == c
    assert complement("red") == "cyan" and complement("white") == "black"


@pytest.mark.parametrize("style", STYLES)
def test_effect_read_on_styled_renders_and_not_on_plain_ones(style):
    styled = [read_effect(render_styled(s, style), s, style) for s in SCENES]
    plain = [read_effect(render_styled(s, None), s, style) for s in SCENES]
    assert all(styled), f"{style}: {styled.count(False)} of {len(SCENES)} styled renders not read as styled"
    assert not any(plain), f"{style}: {sum(plain)} of {len(SCENES)} plain renders read as styled"


@pytest.mark.parametrize("style", STYLES)
def test_styled_renders_keep_the_other_attributes(style):
    for s in SCENES:
        target = style_scene(s, style)
        assert read_scene(render_styled(s, style)).to_scene() == target
        kept = {a for a in ("shape", "position") if getattr(target, a) != getattr(s, a)}
        assert not kept, f"{style} changed {kept} of {s}"


def test_resize_swaps_the_size_only():
    s = Scene("cross", "blue", "yellow", "left", "large")
    assert style_scene(s, "resize") == Scene("cross", "blue", "yellow", "left", "small")
    assert style_scene(s, "invert") == Scene("cross", "yellow", "blue", "left", "large")
    with pytest.raises(ValueError, match="unknown style 'sepia'"):
        style_scene(s, "sepia")
