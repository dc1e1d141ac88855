"""A store of vision-tower embeddings that the encoders of one host share: a directory of safetensors.

Each encoder keeps its own embedding tier; with ``MMCacheConfig.shared_dir`` set, an embedding one
encoder computed is also written to ``<dir>/<mm-hash>.safetensors``, and another encoder's miss
reads it from there before it runs its tower. The mm-hash names the encoder's model
(``model_identity``), the tenant and the exact input, so a file only ever serves the same input
of the same model for the same tenant. Files are written to a temporary name and renamed (a reader
never sees half a file); past ``shared_mb`` the least recently written files are removed.
The head's image affinity (``control.affinity``) sends requests to the encoder that holds their
images; this store is for when that one is busy or gone.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import msgspec
import torch
from safetensors.torch import load_file, save_file

from triptych.mmcache.stats import TierStats

logger = logging.getLogger(__name__)


class SharedStore:
    def __init__(self, root: str | Path, max_bytes: int):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.stats = TierStats()
        self._lock = threading.Lock()

    def _path(self, key: str) -> Path:
        return self.root / f"{key}.safetensors"

    def load(self, key: str, tokens: int) -> torch.Tensor | None:
        """The stored embedding (``tokens`` rows), or None (a miss, or a file of another shape)."""
        try:
            tensor = load_file(self._path(key))["embedding"]
        except Exception as e:  # noqa: BLE001 - a missing or unreadable file is a miss
            if not isinstance(e, FileNotFoundError):
                logger.warning("shared embedding %s unreadable: %s", key[:12], e)
            self.stats.misses += 1
            return None
        if tensor.shape[0] != tokens:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return tensor

    def save(self, key: str, tensor: torch.Tensor) -> None:
        path = self._path(key)
        if path.exists():
            return
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            save_file({"embedding": tensor.detach().cpu().contiguous()}, str(tmp))
            os.replace(tmp, path)
        except OSError as e:
            logger.warning("shared embedding %s not written: %s", key[:12], e)
            tmp.unlink(missing_ok=True)
            self.stats.not_stored += 1
            return
        self._trim()

    def snapshot(self) -> TierStats:
        files = self._files()
        return msgspec.structs.replace(self.stats, entries=len(files), nbytes=sum(size for _, size, _ in files))

    def _files(self) -> list[tuple[float, int, Path]]:
        out = []
        for p in self.root.glob("*.safetensors"):
            try:
                st = p.stat()
            except FileNotFoundError:  # another encoder trimmed it
                continue
            out.append((st.st_mtime, st.st_size, p))
        return sorted(out)

    def _trim(self) -> None:
        with self._lock:
            files = self._files()
            total = sum(size for _, size, _ in files)
            for _, size, p in files:
                if total <= self.max_bytes:
                    break
                p.unlink(missing_ok=True)
                total -= size
                self.stats.evictions += 1
