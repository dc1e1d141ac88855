"""Owner-only state on disk: the head's data directory holds prompts (``jobs.sqlite``) and outputs
(``files/``, ``videos/``), so its directories are 0700 and its files 0600, whatever the umask, like
``worker.token``. Directories made by an older head with wider modes are narrowed when opened.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: Path) -> Path:
    """Create ``path`` (and its parents) if needed and make it owner-only; returns it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    try:
        os.chmod(path, DIR_MODE)
    except PermissionError:  # a directory someone else owns (e.g. --data-dir /srv/shared): say so
        logger.warning("cannot make %s owner-only (it belongs to another user); its files still are", path)
    return path


def private_file(path: Path) -> Path:
    """Create ``path`` empty if it does not exist and make it owner-only (e.g. before SQLite opens it,
    which then gives its ``-wal`` and ``-shm`` files the same mode); returns it."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE))
    os.chmod(path, FILE_MODE)
    return Path(path)


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to a new owner-only file at ``path`` (truncating one that exists)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
