"""The built-in families, one typed ``FamilyEntry`` each: which ``model_index.json`` ``_class_name``
it serves, its adapter class, its tiny-model makers and whether it has a TeaCache plan; and the
look-ups on them.

Nothing here imports a family at import time: each entry's ``adapter``, ``variants`` and ``tiny`` are
plain functions that import the family's module when called (the CLI builds its ``make-tiny``
choices from this table without importing torch)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from triptych.core.errors import UnknownModel
from triptych.families.geometry import model_defaults

if TYPE_CHECKING:
    from triptych.families.base import Family

TinyMaker = Callable[..., Path]  # (out, seed=, size=) -> the model directory


@dataclass(frozen=True)
class FamilyEntry:
    """One built-in family."""

    name: str
    """``Family.name``: TeaCache profiles, metrics and ``make-tiny`` names use it."""
    pipeline: str
    """The diffusers pipeline class (``model_index.json`` ``_class_name``) this family serves."""
    adapter: Callable[[], type[Family]]
    """The family's adapter class (imported when called)."""
    tiny: tuple[tuple[str, Callable[[], TinyMaker]], ...] = ()
    """``make-tiny --family NAME`` → the maker of a seeded tiny model of this family."""
    teacache: bool = False
    """Whether the family has a TeaCache plan (its adapter's ``Family.teacache_plan``): read without
    importing the family (the head's check, the families a refusal names)."""
    variants: tuple[tuple[str, Callable[[], type[Family]]], ...] = ()
    """(``triptych.json`` key, adapter) for a checkpoint of this pipeline class whose ``triptych.json``
    sets the key true: one checkpoint trained for more than its class's job."""


def _flux():
    from triptych.families.flux import family, tiny

    return family, tiny


def _qwen():
    from triptych.families.qwenimage import family, generate_edit, tiny

    return family, tiny, generate_edit


def _wan():
    from triptych.families.wan import family, tiny

    return family, tiny


ENTRIES: tuple[FamilyEntry, ...] = (
    FamilyEntry(
        "flux",
        "FluxPipeline",
        adapter=lambda: _flux()[0].FluxFamily,
        tiny=(("flux", lambda: _flux()[1].make_tiny_flux), ("flux-schnell", lambda: _flux()[1].make_tiny_flux_schnell)),
        teacache=True,
    ),
    FamilyEntry(
        "qwen-image",
        "QwenImagePipeline",
        adapter=lambda: _qwen()[0].QwenImageFamily,
        tiny=(("qwen-image", lambda: _qwen()[1].make_tiny_qwen_image),),
        teacache=True,
        variants=(("edits", lambda: _qwen()[2].QwenImageGenerateEditFamily),),
    ),
    FamilyEntry(
        "qwen-image-edit",
        "QwenImageEditPipeline",
        adapter=lambda: _qwen()[0].QwenImageEditFamily,
        tiny=(("qwen-image-edit", lambda: _qwen()[1].make_tiny_qwen_image_edit),),
        teacache=True,
    ),
    FamilyEntry(
        "wan-t2v",
        "WanPipeline",
        adapter=lambda: _wan()[0].WanFamily,
        tiny=(("wan-t2v", lambda: _wan()[1].make_tiny_wan_t2v),),
        teacache=True,
    ),
    FamilyEntry(
        "wan-i2v",
        "WanImageToVideoPipeline",
        adapter=lambda: _wan()[0].WanImageToVideoFamily,
        tiny=(("wan-i2v", lambda: _wan()[1].make_tiny_wan_i2v),),
        teacache=True,
    ),
)

BY_PIPELINE: dict[str, FamilyEntry] = {e.pipeline: e for e in ENTRIES}
BY_NAME: dict[str, FamilyEntry] = {e.name: e for e in ENTRIES}
TINY: dict[str, Callable[[], TinyMaker]] = {name: maker for e in ENTRIES for name, maker in e.tiny}


def adapters() -> list[type[Family]]:
    """Every adapter class of the built-in families, variants included (imports them all)."""
    return [cls() for e in ENTRIES for cls in (e.adapter, *(v for _, v in e.variants))]


def supported() -> list[str]:
    return sorted(BY_PIPELINE)


def tiny_names() -> list[str]:
    """``make-tiny --family`` choices."""
    return sorted(TINY)


def teacache_families() -> list[str]:
    """Names of the families with a TeaCache plan."""
    return sorted(e.name for e in ENTRIES if e.teacache)


def has_teacache(name: str) -> bool:
    """Whether the family named ``name`` (``Family.name``) has a TeaCache plan."""
    entry = BY_NAME.get(name)
    return entry is not None and entry.teacache


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
    if name not in BY_PIPELINE:
        raise UnknownModel(str(model_dir), f"architecture {name!r} is not supported", supported())
    return name


def family_class(model_dir: str | Path) -> type[Family]:
    entry = BY_PIPELINE[architecture(model_dir)]
    declared = model_defaults(Path(model_dir))
    for key, adapter in entry.variants:
        if declared.get(key) is True:
            return adapter()
    return entry.adapter()


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
    if family not in TINY:
        raise ValueError(f"unknown family {family!r}; choose one of {tiny_names()}")
    return TINY[family]()(out, seed=seed, size=size)
