"""Short-lived generated files behind ``response_format=url`` links.

Each file is ``<data_dir>/files/<id>.<expires_at>.<ext>``, owner-only (``private``): the expiry travels in the name, so the
store needs no index and survives restarts. Ids are random URL-safe tokens (the link is the
capability). ``get`` refuses expired files; ``sweep`` deletes them.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from pathlib import Path

from triptych.core.media import MEDIA_TYPES
from triptych.core.private import private_dir, write_private

_ID_RE = re.compile(r"^[A-Za-z0-9_-]{16,64}$")


class FileStore:
    """Owns ``<data_dir>/files``; every file in it is written and deleted only here."""

    def __init__(self, data_dir: Path, ttl_s: float):
        assert ttl_s > 0
        self.dir = private_dir(Path(data_dir) / "files")
        self.ttl_s = ttl_s

    def put(self, data: bytes, ext: str) -> tuple[str, int]:
        """Store ``data``; returns (file id, unix expiry)."""
        assert ext in MEDIA_TYPES, ext
        file_id = "file-" + secrets.token_urlsafe(18)
        expires = int(time.time() + self.ttl_s)
        tmp = self.dir / f".{file_id}.tmp"
        write_private(tmp, data)
        os.replace(tmp, self.dir / f"{file_id}.{expires}.{ext}")
        return file_id, expires

    def _find(self, file_id: str) -> tuple[Path, int, str] | None:
        if not _ID_RE.match(file_id):
            return None
        for path in self.dir.glob(f"{file_id}.*.*"):
            _, expires, ext = path.name.rsplit(".", 2)
            return path, int(expires), ext
        return None

    def get(self, file_id: str, now: float | None = None) -> tuple[Path, str] | None:
        """(path, media type) of a live file, or None if unknown or expired."""
        found = self._find(file_id)
        if found is None or found[1] <= (time.time() if now is None else now):
            return None
        return found[0], MEDIA_TYPES[found[2]]

    def sweep(self, now: float | None = None) -> int:
        """Delete expired files; returns how many."""
        now = time.time() if now is None else now
        removed = 0
        for path in self.dir.glob("file-*.*.*"):
            try:
                expires = int(path.name.rsplit(".", 2)[1])
            except ValueError:
                continue
            if expires <= now:
                path.unlink(missing_ok=True)
                removed += 1
        return removed
