"""Where the built-in models come from.

``builtin_models`` names every built-in model present (what a bare ``triptych serve`` serves): the
default image model, which also edits, and the video model (``assets/video``) when it is shipped.
The packaged default's ``triptych.json`` says ``"edits": true``: it loads as one family that
generates and edits over one set of weights (``families.qwenimage.generate_edit``), so it is served
once, with one set of pools. Its edit-only directory (``assets/default_edit``, linking the same
weights as a plain ``QwenImageEditPipeline``) is for diffusers users and ``--model default_edit``. The default image model's order: a trained default shipped inside the package (``triptych/assets/default``) when present;
otherwise a tiny seeded model of ``DEFAULT_TINY_FAMILY`` created on first use under the per-user
cache directory (``cache_root``; the CLIs pass ``$TRIPTYCH_CACHE``, default ``~/.cache/triptych``). Creation writes to a temporary
directory and renames it into place, so concurrent first uses never see a half-written model.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

PACKAGED_DEFAULT = Path(__file__).parents[1] / "assets" / "default"
PACKAGED_EDIT = Path(__file__).parents[1] / "assets" / "default_edit"
#: The shape world's tiny Wan 2.1 text-to-video model (``assets/video/MODEL_CARD.md``).
PACKAGED_VIDEO = Path(__file__).parents[1] / "assets" / "video"
DEFAULT_TINY_FAMILY = "flux"


def cache_dir(root: str | os.PathLike | None = None) -> Path:
    """``root``, or the per-user default ``~/.cache/triptych`` (the CLIs pass ``$TRIPTYCH_CACHE``)."""
    return Path(root) if root else Path(os.path.expanduser("~")) / ".cache" / "triptych"


def default_model_dir(cache_root: str | os.PathLike | None = None) -> Path:
    if (PACKAGED_DEFAULT / "model_index.json").is_file():
        return PACKAGED_DEFAULT
    return ensure_tiny(DEFAULT_TINY_FAMILY, cache_root=cache_root)


def builtin_models(cache_root: str | os.PathLike | None = None) -> dict[str, Path]:
    """Model id → directory of each built-in model present, image model first: the default image
    model (the packaged one also edits) and the video model. The id is the directory's name."""
    found = [default_model_dir(cache_root)]
    video = default_video_model_dir()
    if video is not None:
        found.append(video)
    return {d.name: d for d in found}


def default_video_model_dir() -> Path | None:
    """The packaged text-to-video model, or None when the package ships none."""
    return PACKAGED_VIDEO if (PACKAGED_VIDEO / "model_index.json").is_file() else None


def ensure_tiny(family: str, seed: int = 0, size: str = "tiny", cache_root: str | os.PathLike | None = None) -> Path:
    from triptych.families.registry import make_tiny

    target = cache_dir(cache_root) / "models" / f"tiny-{family}-{size}-seed{seed}"
    if (target / "model_index.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("creating tiny %s model in %s (first use)", family, target)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        make_tiny(family, tmp, seed=seed, size=size)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is identical
            if not (target / "model_index.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(model: str | None, cache_root: str | os.PathLike | None = None) -> Path:
    return Path(model) if model else default_model_dir(cache_root)
