"""Triptych's procedural shape world: scenes, renderer, captions, edits, scorer.

The default tiny Qwen-Image-family model is trained on this world, and its
outputs are graded by reading scenes back from pixels.  See README.md here.
"""

from shapeworld.captions import CAPTION_STYLES, caption, parse_caption, score_caption
from shapeworld.edits import (
    EditPair,
    apply_instruction,
    changed_attributes,
    edit_instruction,
    make_edit,
    sample_edit_pairs,
)
from shapeworld.render import render, render_array
from shapeworld.scene import (
    ATTRIBUTES,
    COLOR_NAMES,
    COLORS,
    POSITIONS,
    SHAPES,
    SIZES,
    PartialScene,
    Scene,
    all_combinations,
    combination_split,
    combinations,
    iter_all_scenes,
    sample_scenes,
)
from shapeworld.scorer import accuracy, read_scene, score

__all__ = [
    "ATTRIBUTES",
    "CAPTION_STYLES",
    "COLORS",
    "COLOR_NAMES",
    "POSITIONS",
    "SHAPES",
    "SIZES",
    "EditPair",
    "PartialScene",
    "Scene",
    "accuracy",
    "all_combinations",
    "apply_instruction",
    "caption",
    "changed_attributes",
    "combination_split",
    "combinations",
    "edit_instruction",
    "iter_all_scenes",
    "make_edit",
    "parse_caption",
    "read_scene",
    "render",
    "render_array",
    "sample_edit_pairs",
    "sample_scenes",
    "score",
    "score_caption",
]
