"""What names a model: one hash of a model directory's configuration files.

Every place that needs to tell models apart uses this hash: the head and its workers check they
loaded the same model (``model_revision`` of the whole directory); a TeaCache profile records the
transformer it was fitted on and an mm-hash cache scopes its keys by the encoder
(``model_identity`` of one component). Torch-free: the head computes it without loading weights.

NOTE: it hashes configurations (``.json`` and ``.txt`` files: model configs, tokenizer files,
scheduler settings, ``triptych.json``), not weights, so it is cheap for a 15 GB encoder but does
not see a retrained checkpoint of the same shape: give each checkpoint its own directory name
(which ``model_identity`` includes) or pass an explicit name where one is accepted.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

CONFIG_SUFFIXES = (".json", ".txt")


def model_revision(model_dir: str | Path, components: Sequence[str] | None = None) -> str:
    """sha256 (first 16 hex digits) over the config files, each as relative path + bytes, sorted.

    ``components`` limits it to those subfolders (``("transformer",)``); None hashes the whole
    directory. A missing component contributes nothing. The value does not depend on where the
    directory is, so two hosts holding the same model agree.
    """
    root = Path(model_dir)
    tops = [root] if components is None else [root / c for c in components]
    files = sorted(
        p for top in tops if top.is_dir() for p in top.rglob("*") if p.is_file() and p.suffix in CONFIG_SUFFIXES
    )
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def model_identity(model_dir: str | Path, components: Sequence[str] | None = None) -> str:
    """``<directory name>@<model_revision>``: the revision with the model's name in front, for
    records a person reads (a TeaCache profile's ``model``, a cache scope)."""
    return f"{Path(model_dir).resolve().name}@{model_revision(model_dir, components)}"
