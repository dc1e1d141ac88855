"""A model directory's components from configs alone: each one's class (``model_index.json``), its
``config.json`` and the module built from it on the meta device. A component without a config, or
whose class is not importable here, is ``unknown`` with the reason."""

from __future__ import annotations

import importlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from triptych.plan.trace import meta_module, parameters, read_config

#: bytes per weight in each storage format the plan prices (fp8 and int8: one byte a weight)
WEIGHT_BYTES = {"bf16": 2, "fp8": 1, "int8": 1}


@dataclass
class Component:
    name: str
    cls_name: str
    config: dict[str, Any] | None
    module: Any = None  # the meta module; None when unknown
    params: int | None = None
    unknown: str | None = None  # why nothing is known of it

    def weight_bytes(self) -> dict[str, int] | None:
        if self.params is None:
            return None
        return {fmt: self.params * n for fmt, n in WEIGHT_BYTES.items()}


def _class(library: str, name: str):
    module = importlib.import_module(library)
    return getattr(module, name)


def load(model_dir: Path, name: str, dtype: torch.dtype = torch.bfloat16) -> Component:
    """Component ``name`` of ``model_dir`` built on meta (or unknown, with why)."""
    index = json.loads((model_dir / "model_index.json").read_text())
    entry = index.get(name)
    if not isinstance(entry, list) or entry[0] is None:
        return Component(name, "", None, unknown="not in model_index.json")
    library, cls_name = entry
    config = read_config(model_dir / name / "config.json")
    if config is None:
        return Component(name, cls_name, None, unknown=f"no {name}/config.json")
    try:
        cls = _class(library, cls_name)
    except (ImportError, AttributeError) as e:
        return Component(name, cls_name, config, unknown=f"class {library}.{cls_name} not importable ({e})")
    quiet = logging.getLogger("diffusers.models.modeling_utils"), logging.getLogger("transformers")
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        module = meta_module(cls, config, dtype)
    except Exception as e:  # noqa: BLE001 - a config this diffusers cannot build is reported, not raised
        return Component(name, cls_name, config, unknown=f"cannot build {cls_name} from its config ({e})")
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
    return Component(name, cls_name, config, module, parameters(module))
