"""Model geometry read from config files, so a role that did not load the VAE still knows it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def vae_config(model_dir: Path) -> dict[str, Any]:
    return read_json(Path(model_dir) / "vae" / "config.json")


def model_defaults(model_dir: Path) -> dict[str, Any]:
    """Optional ``triptych.json`` beside ``model_index.json``: default size/steps/guidance of a model.

    Real checkpoints do not have one and get the family's defaults; tiny and trained models written
    by Triptych record theirs (e.g. 64×64, 4 steps).
    """
    path = Path(model_dir) / "triptych.json"
    return read_json(path) if path.exists() else {}


def trained_sizes(model_dir: Path) -> tuple[tuple[int, int], ...]:
    """The (width, height) sizes a model was trained at, from ``"trained_sizes": ["64x64", ...]`` in
    its ``triptych.json``; empty when it does not say (real checkpoints: no warning)."""
    sizes = []
    for text in model_defaults(model_dir).get("trained_sizes", ()):
        w, _, h = str(text).partition("x")
        sizes.append((int(w), int(h)))
    return tuple(sizes)


def size_warning(name: str, sizes: tuple[tuple[int, int], ...], width: int, height: int) -> str | None:
    """One line when ``width`` x ``height`` is not among a model's trained ``sizes`` (None otherwise)."""
    if not sizes or (width, height) in sizes:
        return None
    trained = ", ".join(f"{w}x{h}" for w, h in sizes)
    return (
        f"model {name!r} was trained at {trained} only; at {width}x{height} it may draw nothing useful "
        f"(e.g. a blank image)"
    )
