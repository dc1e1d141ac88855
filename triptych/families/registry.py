"""Architecture name (``model_index.json`` ``_class_name``) → family adapter; tiny-model makers."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from triptych.core.errors import UnknownModel
from triptych.families.geometry import model_defaults

# Pipeline class name → "module:Class" of its adapter; imported lazily.
FAMILIES: dict[str, str] = {
    "FluxPipeline": "triptych.families.flux.family:FluxFamily",
    "QwenImagePipeline": "triptych.families.qwenimage.family:QwenImageFamily",
    "QwenImageEditPipeline": "triptych.families.qwenimage.family:QwenImageEditFamily",
    "WanPipeline": "triptych.families.wan.family:WanFamily",
    "WanImageToVideoPipeline": "triptych.families.wan.family:WanImageToVideoFamily",
}

# (pipeline class, ``triptych.json`` key) → the adapter of a checkpoint of that class whose
# ``triptych.json`` sets the key true: one checkpoint trained for more than its class's job.
VARIANTS: dict[tuple[str, str], str] = {
    ("QwenImagePipeline", "edits"): "triptych.families.qwenimage.generate_edit:QwenImageGenerateEditFamily",
}

# make-tiny --family NAME → "module:function(out, seed, size)".
TINY_MAKERS: dict[str, str] = {
    "flux": "triptych.families.flux.tiny:make_tiny_flux",
    "flux-schnell": "triptych.families.flux.tiny:make_tiny_flux_schnell",
    "qwen-image": "triptych.families.qwenimage.tiny:make_tiny_qwen_image",
    "qwen-image-edit": "triptych.families.qwenimage.tiny:make_tiny_qwen_image_edit",
    "wan-t2v": "triptych.families.wan.tiny:make_tiny_wan_t2v",
    "wan-i2v": "triptych.families.wan.tiny:make_tiny_wan_i2v",
}


def _load(target: str):
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def supported() -> list[str]:
    return sorted(FAMILIES)


def architecture(model_dir: str | Path) -> str:
    """The pipeline class a model directory declares; raises ``UnknownModel`` if it is not ours."""
    index = Path(model_dir) / "model_index.json"
    if not Path(model_dir).is_dir():
        raise UnknownModel(str(model_dir), "not a directory", supported())
    if not index.is_file():
        raise UnknownModel(str(model_dir), "no model_index.json (not a diffusers model directory)", supported())
    try:
        name = json.loads(index.read_text())["_class_name"]
    except (ValueError, KeyError) as e:
        raise UnknownModel(str(model_dir), f"unreadable model_index.json ({e})", supported()) from e
    if name not in FAMILIES:
        raise UnknownModel(str(model_dir), f"architecture {name!r} is not supported", supported())
    return name


def family_class(model_dir: str | Path):
    name = architecture(model_dir)
    declared = model_defaults(Path(model_dir))
    for (arch, key), target in VARIANTS.items():
        if arch == name and declared.get(key) is True:
            return _load(target)
    return _load(FAMILIES[name])


def load_family(model_dir: str | Path, roles=None, device="cpu", dtype=None, mm_cache_config=None, speed=None):
    """Load the adapter for ``model_dir`` with only the components ``roles`` need.

    ``device``: a device name (with ``dtype``, None = auto) or a ``triptych.core.devices.DeviceConfig``;
    ``mm_cache_config``: a ``triptych.mmcache.cache.MMCacheConfig`` (None = its defaults); ``speed``: a
    ``triptych.accel.SpeedConfig`` (None = neither compiled nor quantized)."""
    from triptych.accel import SpeedConfig
    from triptych.families.base import ALL_ROLES
    from triptych.mmcache.cache import MMCacheConfig

    cls = family_class(model_dir)
    return cls(
        model_dir,
        roles=ALL_ROLES if roles is None else roles,
        device=device,
        dtype=dtype,
        mm_cache_config=mm_cache_config or MMCacheConfig(),
        speed=speed or SpeedConfig(),
    )


def make_tiny(family: str, out: str | Path, seed: int = 0, size: str = "tiny") -> Path:
    if family not in TINY_MAKERS:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(TINY_MAKERS)}")
    return _load(TINY_MAKERS[family])(out, seed=seed, size=size)
