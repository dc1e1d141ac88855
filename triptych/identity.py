"""Model identity: one hash that names a model directory's configuration (no torch)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def model_revision(model_dir: str | Path) -> str:
    """sha256 over the model directory's JSON/text configs (relative path + bytes), sorted."""
    root = Path(model_dir)
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".json", ".txt")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]
