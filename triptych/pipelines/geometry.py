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
