"""Run-time adapter registration (``POST /v1/loras``): where a requested path may point.

A path is taken only if it resolves (symlinks followed) under the deployment's allowed root
(``serve --lora-root DIR``); a relative path is relative to that root. A URL, a path outside the
root, a symlink leading out of it, or a missing adapter is an ``InvalidParam`` naming the field,
the value and the rule. Torch-free (the head runs it).
"""

from __future__ import annotations

import re
from pathlib import Path

from triptych.core.errors import InvalidParam, TriptychError
from triptych.lora.paths import weight_file

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidParam(
            "name", name, "must be 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit"
        )
    return name


def resolve_under_root(root: str, value: str) -> Path:
    """The adapter's weight file for ``value`` under ``root``; ``InvalidParam`` on field ``path``."""
    if not root:
        raise InvalidParam("path", value, "run-time loading is off: start the server with --lora-root DIR")
    if not isinstance(value, str) or not value or "://" in value:
        raise InvalidParam("path", value, f"must be a folder or .safetensors file under {root}, not a URL")
    base = Path(root).resolve()
    target = (base / value).resolve()
    if not target.is_relative_to(base):
        raise InvalidParam("path", value, f"must resolve under the allowed root {root} (symlinks followed)")
    try:
        file = weight_file(target)
    except TriptychError as e:
        raise InvalidParam("path", value, f"must be an adapter folder or .safetensors file: {e}") from None
    file = file.resolve()  # the file the denoisers load: a link swapped later does not move it
    if not file.is_relative_to(base):
        raise InvalidParam("path", value, f"must resolve under the allowed root {root} (symlinks followed)")
    return file
