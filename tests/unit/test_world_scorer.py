"""Pixel scorer accuracy on rendered, degraded and degenerate images."""

from __future__ import annotations

import random

import numpy as np
import pytest
from PIL import Image, ImageFilter

from shapeworld import ATTRIBUTES, Scene, accuracy, iter_all_scenes, read_scene, render, score


def _scenes(n: int, seed: int) -> list[Scene]:
    scenes = iter_all_scenes("all")  # 2240 scenes: every combination x position x size
    random.Random(seed).shuffle(scenes)
    return scenes[:n]


def _degrade(image: Image.Image, blur: float, noise: float, rng: np.random.Generator) -> Image.Image:
    image = image.filter(ImageFilter.GaussianBlur(blur))
    arr = np.asarray(image, dtype=np.float32) + rng.normal(0.0, noise, (*image.size[::-1], 3))
    return Image.fromarray(np.clip(arr, 0, 255).round().astype(np.uint8))


def test_clean_accuracy_64() -> None:
    acc = accuracy([score(render(s), s) for s in _scenes(600, seed=0)])
    assert all(acc[a] >= 0.99 for a in ATTRIBUTES), acc


@pytest.mark.parametrize("size", [32, 128])
def test_clean_accuracy_other_sizes(size: int) -> None:
    acc = accuracy([score(render(s, size), s) for s in _scenes(120, seed=size)])
    assert all(acc[a] >= 0.99 for a in ATTRIBUTES), acc


def test_noisy_blurred_accuracy_64() -> None:
    rng = np.random.default_rng(0)
    results = [score(_degrade(render(s), 1.0, 12.0, rng), s) for s in _scenes(500, seed=1)]
    acc = accuracy(results)
    assert all(acc[a] >= 0.95 for a in ATTRIBUTES), acc


def test_colour_drift_and_array_inputs() -> None:
    scene = Scene("triangle", "red", "green", "top", "large")
    arr = np.asarray(render(scene), dtype=np.float32)
    drifted = np.clip(arr * 0.75 + 30, 0, 255).astype(np.uint8)  # washed-out colours
    assert all(score(drifted, scene).values())
    assert all(score(arr / 255.0, scene).values())  # float HWC in 0..1
    assert all(score(np.moveaxis(arr, -1, 0).astype(np.uint8), scene).values())  # CHW


def test_degenerate_images_do_not_crash() -> None:
    blank = read_scene(Image.new("RGB", (64, 64), (0, 0, 255)))
    assert blank.background == "blue" and blank.shape is None and blank.color is None
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3)).astype(np.uint8)
    assert read_scene(noise).shape is None
    assert read_scene(np.zeros((4, 4, 3), np.uint8)).shape is None
    assert read_scene(Image.new("L", (64, 64), 255)).background == "white"
    dot = np.zeros((64, 64, 3), np.uint8)
    dot[30, 30] = 255  # a single speck is not a shape
    assert read_scene(dot).shape is None
