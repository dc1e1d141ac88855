"""Keys of the head's result cache (``result_cache``): one digest of everything that determines a
generation's output bytes.

``ResultKeys.base(model_id, family, job, ...)`` digests, without the seed:

- the served model: its id, its family, ``model_identity`` of its directory, and a signature
  (relative path, size, modification time) of every file under it, so weights replaced in place
  (which ``model_identity``, a hash of configurations, does not see) give new keys, as do the model's
  own TeaCache profiles and shipped adapters;
- the request's resolved parameters: prompt, negative prompt, size, frames, steps, guidance,
  ``true_cfg``, TeaCache threshold (and, when it is not 0, the signature of the user profile
  directory the threshold is resolved against), the tenant, each LoRA adapter by name, scale and
  the sha256 of its weight file, and the condition image by the sha256 of its decoded pixels;
- how the output is encoded: format, jpeg/webp quality, video frame rate.

``for_seed(base, seed)`` adds the seed, so the images of one ``n`` > 1 request (seeds ``seed``,
``seed + 1``, ...) each have the key a single request with that seed has.

What the head cannot see is not in the key: the workers' own settings (dtype, attention kernel,
compile, quantization). Every worker of a model is taken to produce the same bytes for the same job,
as routing already assumes (any worker may run any job); the head's own flags, and so those of the
workers it starts, cannot change without a restart, which empties the cache.

Blocking (it stats files and hashes images and adapters): call it off the event loop. Adapter
digests are remembered per file while its size, modification time and inode stay the same.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from triptych.accel.teacache_profile import AUTO_THRESHOLD, profiles_dir_in
from triptych.core.identity import model_identity

if TYPE_CHECKING:
    from triptych.control.backend import GenerationJob

_CHUNK = 1 << 20


def tree_signature(root: Path) -> str:
    """sha256 over (relative path, size, mtime_ns) of every file under ``root``; "" when it is absent."""
    root = Path(root)
    if not root.is_dir():
        return ""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        st = path.stat()
        digest.update(f"{path.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return digest.hexdigest()


def image_digest(image) -> str:
    """sha256 of a PIL image's mode, size and pixels (two encodings of the same pixels agree)."""
    digest = hashlib.sha256(f"{image.mode}\0{image.size[0]}x{image.size[1]}\0".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class ResultKeys:
    """Builds result-cache keys (module docstring); remembers adapter and model digests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the offload pool may build several keys at once
        self._files: dict[str, tuple[tuple[int, int, int], str]] = {}
        self._models: dict[str, tuple[str, str]] = {}  # model dir → (tree signature, identity)

    def _adapter(self, path: Path) -> str:
        st = os.stat(path)
        sig = (st.st_size, st.st_mtime_ns, st.st_ino)
        with self._lock:
            known = self._files.get(str(path))
        if known is not None and known[0] == sig:
            return known[1]
        value = file_digest(path)
        with self._lock:
            self._files[str(path)] = (sig, value)
        return value

    def _model(self, model_dir: Path) -> list[str]:
        sig = tree_signature(model_dir)
        with self._lock:
            known = self._models.get(str(model_dir))
        if known is None or known[0] != sig:
            known = (sig, model_identity(model_dir))
            with self._lock:
                self._models[str(model_dir)] = known
        return list(known)

    def base(
        self,
        model_id: str,
        family,
        job: GenerationJob,
        adapter_files: Mapping[str, Path],
        profiles_root: Path | None = None,
    ) -> str:
        """The digest of ``job`` on the served model ``model_id`` (of ``family``) without its seed
        (module docstring). ``adapter_files``: adapter name → weight file (every one ``job`` names);
        ``profiles_root``: ``HeadConfig.teacache_profiles_root``."""
        p = job.params
        teacache_profiles = ""
        if profiles_root and p.teacache_threshold:
            teacache_profiles = tree_signature(profiles_dir_in(profiles_root, family.model_dir))
        record = {
            "model": [model_id, family.name, *self._model(Path(family.model_dir))],
            "prompt": p.prompt,
            "negative_prompt": p.negative_prompt,
            "size": [p.width, p.height, p.frames],
            "steps": p.steps,
            "guidance": p.guidance,
            "true_cfg": p.true_cfg,
            "teacache": ["auto" if p.teacache_threshold == AUTO_THRESHOLD else p.teacache_threshold, teacache_profiles],
            "tenant": p.tenant,
            "lora": [[name, scale, self._adapter(adapter_files[name])] for name, scale in p.lora],
            "image": None if p.image is None else image_digest(p.image),
            "output": [job.output_format, job.quality, job.fps if job.output_format == "mp4" else None],
        }
        text = json.dumps(record, sort_keys=True, separators=(",", ":"), allow_nan=False)
        return hashlib.sha256(text.encode()).hexdigest()

    @staticmethod
    def for_seed(base: str, seed: int) -> str:
        """The key of the image or video with ``seed`` (``base`` from ``base``)."""
        return hashlib.sha256(f"{base}\0seed={seed}".encode()).hexdigest()
