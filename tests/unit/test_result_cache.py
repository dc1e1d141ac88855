"""``ResultCache`` (byte-bounded LRU) and ``ResultKeys`` (what the key depends on)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from triptych.control.backend import GenerationJob
from triptych.families.base import GenerationParams
from triptych.head.result_cache import ResultCache
from triptych.head.result_key import ResultKeys
from triptych.head.state import HeadConfig

TEN = b"0123456789"  # one 10-byte result


def test_capacity_evicts_the_least_recently_used_by_bytes():
    cache = ResultCache(capacity_bytes=30)
    for key in "abc":
        assert cache.put(key, TEN)
    assert cache.get("a") == TEN  # a is now the most recently used
    assert cache.put("d", TEN)  # 40 bytes > 30: b (least recently used) goes
    assert "b" not in cache and all(k in cache for k in "acd")
    assert cache.nbytes == 30 and cache.evictions == 1
    assert cache.put("e", TEN * 2)  # 20 more bytes: two entries (c, then a) go
    assert [k in cache for k in "acde"] == [False, False, True, True]
    assert cache.nbytes == 30 and cache.evictions == 3


def test_a_result_larger_than_the_capacity_is_not_stored_and_evicts_nothing():
    cache = ResultCache(capacity_bytes=25)
    cache.put("a", TEN)
    assert not cache.put("big", TEN * 3)
    assert "a" in cache and "big" not in cache and cache.not_stored == 1 and cache.evictions == 0


def test_replacing_a_key_counts_its_bytes_once():
    cache = ResultCache(capacity_bytes=25)
    cache.put("a", TEN)
    cache.put("a", TEN * 2)
    assert cache.nbytes == 20 and len(cache) == 1 and cache.get("a") == TEN * 2


def test_hits_and_misses_are_counted_and_zero_capacity_stores_nothing():
    cache = ResultCache(capacity_bytes=10)
    assert cache.get("a") is None
    cache.put("a", TEN)
    assert cache.get("a") == TEN
    s = cache.stats()
    assert (s.hits, s.misses, s.entries, s.nbytes, s.capacity_bytes) == (1, 1, 1, 10, 10)
    off = ResultCache(0)
    assert not off.enabled and not off.put("a", b"x") and len(off) == 0
    with pytest.raises(ValueError, match="capacity_bytes"):
        ResultCache(-1)


@pytest.mark.parametrize("mb", [-1.0, float("nan"), float("inf")])
def test_head_config_refuses_a_bad_capacity(tmp_path, mb):
    with pytest.raises(ValueError, match="result_cache_mb"):
        HeadConfig(data_dir=tmp_path, result_cache_mb=mb)


class _Family:
    name = "fake"

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir


@pytest.fixture
def keyed(tmp_path):
    """(key of params/job changes, the model dir, the adapter files)."""
    model_dir = tmp_path / "model"
    (model_dir / "transformer").mkdir(parents=True)
    (model_dir / "transformer" / "config.json").write_text('{"layers": 2}')
    (model_dir / "transformer" / "weights.safetensors").write_bytes(b"w" * 64)
    adapters = {"style": tmp_path / "style.safetensors", "other": tmp_path / "other.safetensors"}
    adapters["style"].write_bytes(b"style-v1")
    adapters["other"].write_bytes(b"other-v1")
    keys = ResultKeys()
    base = GenerationParams(prompt="a cube", height=32, width=32, frames=1, steps=2, guidance=3.0, seed=5)

    def key(job_changes: dict | None = None, **changes) -> str:
        job = GenerationJob("r", base.replace(**changes), **{"output_format": "png", **(job_changes or {})})
        return ResultKeys.for_seed(
            keys.base("m", _Family(model_dir), job, adapters, tmp_path / "profiles"), job.params.seed
        )

    return key, model_dir, adapters


def _image(value: int) -> Image.Image:
    return Image.fromarray(np.full((16, 16, 3), value, dtype=np.uint8))


@pytest.mark.parametrize(
    "change",
    [
        {"prompt": "a sphere"},
        {"negative_prompt": "blurry"},
        {"seed": 6},
        {"steps": 3},
        {"height": 48},
        {"frames": 5},
        {"guidance": 3.5},
        {"true_cfg": 2.0},
        {"teacache_threshold": 0.3},
        {"tenant": "key-0123"},
        {"lora": (("style", 1.0),)},
        {"image": _image(1)},
    ],
    ids=lambda c: next(iter(c)),
)
def test_every_parameter_that_sets_the_bytes_changes_the_key(keyed, change):
    key, _, _ = keyed
    assert key() == key()
    assert key(**change) != key()


@pytest.mark.parametrize("job", [{"output_format": "jpeg"}, {"quality": 80}], ids=lambda c: next(iter(c)))
def test_the_encoding_changes_the_key(keyed, job):
    key, _, _ = keyed
    assert key(job) != key()


def test_adapters_are_keyed_by_name_scale_and_content(keyed):
    key, _, adapters = keyed
    style = key(lora=(("style", 1.0),))
    assert key(lora=(("style", 0.5),)) != style
    assert key(lora=(("other", 1.0),)) != style
    adapters["style"].write_bytes(b"style-v2")  # the same name, new weights
    assert key(lora=(("style", 1.0),)) != style


def test_the_input_image_is_keyed_by_its_pixels(keyed):
    key, _, _ = keyed
    assert key(image=_image(1)) == key(image=_image(1))
    assert key(image=_image(1)) != key(image=_image(2))


def test_weights_replaced_in_place_change_the_key(keyed):
    key, model_dir, _ = keyed
    before = key()
    weights = model_dir / "transformer" / "weights.safetensors"
    weights.write_bytes(b"v" * 65)
    os.utime(weights, ns=(1, 1))
    assert key() != before


def test_a_user_teacache_profile_change_changes_only_teacache_keys(keyed, tmp_path):
    from triptych.accel.teacache_profile import profiles_dir_in

    key, model_dir, _ = keyed
    on, off = key(teacache_threshold=0.3), key()
    profiles = profiles_dir_in(tmp_path / "profiles", model_dir)
    profiles.mkdir(parents=True)
    (profiles / "profile.json").write_text("{}")
    assert key(teacache_threshold=0.3) != on and key() == off
