"""The run-time adapters a head serves, kept on disk so a restarted head serves them again.

``POST /v1/loras`` and ``DELETE /v1/loras/{name}`` change a model's catalog; each change rewrites
``<data_dir>/loras/<model key>.json`` (atomically: a temporary file, then a rename; owner-only),
holding the adapters loaded at run time (name → weight file) and every name this head ever gave a
file (names are not reused for another file, across restarts too). A restarted head replays it:
each adapter is checked again as a new ``POST`` would be (still under ``--lora-root``, still a
readable adapter that fits the model); one that no longer passes is dropped and logged, never
served unchecked. Torch-free (the head runs it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class JournalState:
    added: dict[str, Path] = field(default_factory=dict)
    ever: dict[str, Path] = field(default_factory=dict)


class LoraJournal:
    def __init__(self, data_dir: Path, model_name: str):
        key = hashlib.sha256(model_name.encode()).hexdigest()[:16]
        self.path = Path(data_dir) / "loras" / f"{key}.json"
        self.model_name = model_name

    def load(self) -> JournalState:
        """What the last head wrote (empty when nothing was, or the file is unreadable: logged)."""
        try:
            raw = json.loads(self.path.read_text())
            if raw.get("model") != self.model_name:
                raise ValueError(f"written for model {raw.get('model')!r}")
            return JournalState(
                {str(k): Path(v) for k, v in raw["added"].items()},
                {str(k): Path(v) for k, v in raw["ever"].items()},
            )
        except FileNotFoundError:
            return JournalState()
        except (OSError, ValueError, KeyError, AttributeError) as e:
            log.warning("run-time LoRA journal %s ignored: %s", self.path, e)
            return JournalState()

    def save(self, state: JournalState) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        body = {
            "model": self.model_name,
            "added": {k: str(v) for k, v in state.added.items()},
            "ever": {k: str(v) for k, v in state.ever.items()},
        }
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(body, f, indent=1)
        os.replace(tmp, self.path)
