"""Scene model, splits, sampling determinism, captions and edit pairs."""

from __future__ import annotations

import hashlib

import pytest

from shapeworld import (
    ATTRIBUTES,
    COLORS,
    SHAPES,
    PartialScene,
    Scene,
    all_combinations,
    apply_instruction,
    caption,
    changed_attributes,
    combinations,
    iter_all_scenes,
    make_edit,
    parse_caption,
    render,
    sample_edit_pairs,
    sample_scenes,
)


def test_vocabulary_and_validation() -> None:
    for name in ("red", "green", "blue", "yellow", "white", "black"):
        assert name in COLORS
    assert len(COLORS) == 8 and len(SHAPES) == 4
    rgb = list(COLORS.values())
    assert min(sum((a - b) ** 2 for a, b in zip(x, y)) ** 0.5 for i, x in enumerate(rgb) for y in rgb[i + 1 :]) >= 250
    with pytest.raises(ValueError):
        Scene("circle", "red", "red")
    with pytest.raises(ValueError):
        Scene("hexagon", "red", "blue")
    assert PartialScene("circle", "red", "blue", "left", "small").to_scene() == Scene(
        "circle", "red", "blue", "left", "small"
    )
    assert PartialScene("circle", "red", "red", "left", "small").to_scene() is None


def test_splits_are_disjoint_and_cover_every_word() -> None:
    train, held = set(combinations("train")), set(combinations("heldout"))
    assert train.isdisjoint(held)
    assert train | held == set(all_combinations()) and len(all_combinations()) == 224
    assert 0.05 <= len(held) / 224 <= 0.15
    for k in range(3):  # every single word still appears in train and in held-out
        assert {c[k] for c in held} == {c[k] for c in train}
    tr = sample_scenes(2000, seed=3, split="train")
    he = sample_scenes(300, seed=3, split="heldout")
    assert {s.combination for s in tr} <= train and {s.combination for s in he} <= held
    assert {s.split for s in tr} == {"train"} and {s.split for s in he} == {"heldout"}
    assert {s.position for s in he} == {"left", "right", "top", "bottom", "centre"}


def test_sampling_and_rendering_are_deterministic() -> None:
    a, b = sample_scenes(50, seed=7), sample_scenes(50, seed=7)
    assert a == b and sample_scenes(20, seed=7) == a[:20]
    assert sample_scenes(50, seed=8) != a

    def digest(scenes):
        return hashlib.sha256(b"".join(render(s).tobytes() for s in scenes)).hexdigest()

    assert digest(a[:20]) == digest(b[:20])
    assert sample_edit_pairs(30, seed=1) == sample_edit_pairs(30, seed=1)
    for size in (32, 64, 128):
        im = render(a[0], size)
        assert im.mode == "RGB" and im.size == (size, size)


def test_caption_parse_round_trip() -> None:
    for scene in iter_all_scenes("all"):
        full = parse_caption(caption(scene, "long"))
        assert full.to_scene() == scene, caption(scene, "long")
        assert parse_caption(caption(scene, "tag")).to_scene() == scene
        short = parse_caption(caption(scene, "short"))
        assert (short.shape, short.color, short.background) == scene.combination
    assert caption(Scene("circle", "red", "blue")) == "a red circle on a blue background"
    assert caption(Scene("circle", "red", "blue", "left", "small"), "long") == (
        "a small red circle at the left on a blue background"
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The image shows a red circle.", ("circle", "red", None)),
        ("a red circle on a blue background.", ("circle", "red", "blue")),
        ("A blue background with a red square in the middle.", ("square", "red", "blue")),
        ("The background is yellow and there is a purple triangle.", ("triangle", "magenta", "yellow")),
        ("White plus sign on a BLACK background", ("cross", "white", "black")),
        ("It is a green shape over a cyan backdrop", (None, "green", "cyan")),
        ("I can't tell.", (None, None, None)),
    ],
)
def test_parse_free_text(text: str, expected: tuple) -> None:
    p = parse_caption(text)
    assert (p.shape, p.color, p.background) == expected


def test_edit_pairs_change_exactly_one_attribute() -> None:
    train_combos, held_combos = set(combinations("train")), set(combinations("heldout"))
    train = sample_edit_pairs(400, seed=0, split="train")
    held = sample_edit_pairs(200, seed=0, split="heldout")
    for pair in train + held:
        assert changed_attributes(pair.source, pair.target) == [pair.attribute]
        assert apply_instruction(pair.source, pair.instruction) == pair.target, pair.instruction
    assert all(p.source.combination in train_combos and p.target.combination in train_combos for p in train)
    assert all(p.target.combination in held_combos for p in held)
    assert {p.attribute for p in train} == set(ATTRIBUTES)
    src = Scene("circle", "red", "blue", "centre", "large")
    assert make_edit(src, "color", "green").instruction == "make the circle green"
    assert make_edit(src, "background", "yellow").instruction == "change the background to yellow"
    assert make_edit(src, "shape", "square").instruction == "make it a square"
    assert make_edit(src, "position", "left").instruction == "move the circle to the left"
    with pytest.raises(ValueError):
        make_edit(src, "color", "blue")  # would equal the background
