"""TeaCache profile /2 additions with fakes: "auto" resolves to the recommendation (or is refused
naming the field), the cap on consecutive skips holds, /1 profiles still load, REST maps "auto"."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tests.unit.test_teacache import FakePlan, FakeRow, base_forward, ones, profile
from triptych.accel.teacache import TeaCache
from triptych.accel.teacache_profile import AUTO_THRESHOLD, load_profile, save_profile
from triptych.core.errors import InvalidParam


def test_auto_is_the_profiles_recommendation():
    prof = replace(profile(), recommended_threshold=0.25)
    tc = TeaCache(FakePlan().plan, profiles=lambda steps: prof)
    assert tc.resolve(AUTO_THRESHOLD, 6).threshold == 0.25
    assert tc.resolve(0.5, 6).threshold == 0.5


def test_auto_without_a_recommendation_names_the_field():
    tc = TeaCache(FakePlan().plan, profiles=lambda steps: profile())
    with pytest.raises(InvalidParam, match="teacache_threshold.*recommended threshold"):
        tc.resolve(AUTO_THRESHOLD, 6)
    with pytest.raises(InvalidParam, match="no profile found"):
        TeaCache(FakePlan().plan).resolve(AUTO_THRESHOLD, 6)


def _skips(max_skips):
    prof = replace(profile(steps=10, warmup=1, cooldown=0), max_skips=max_skips)
    tc = TeaCache(FakePlan().plan, profiles=lambda steps: prof)
    decisions = []
    for step in range(10):  # tiny input changes: without a cap every step after the first would skip
        tc.forward([FakeRow("a", step, ones(1 + step * 1e-4), threshold=1.0, steps=10)], base_forward)
        decisions.append(tc.last_decisions[0].compute)
    return decisions


def test_a_cap_on_consecutive_skips_forces_a_compute():
    assert _skips(None) == [True] + [False] * 9
    capped = _skips(2)
    assert capped == [True, False, False, True, False, False, True, False, False, True]


def test_format_1_profiles_still_load_without_a_recommendation(tmp_path):
    data = profile().to_json()
    data["format"] = "triptych.teacache.profile/1"
    for key in ("max_skips", "recommended_threshold", "target", "sweep"):
        del data[key]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = load_profile(tmp_path / "old.json")
    assert old.recommended_threshold is None and old.max_skips is None and old.coefficients == profile().coefficients
    prof = replace(profile(), recommended_threshold=0.1, max_skips=3)
    again = load_profile(save_profile(prof, tmp_path / "new.json"))
    assert (again.recommended_threshold, again.max_skips) == (0.1, 3)


def test_rest_models_map_auto_and_refuse_other_words():
    from pydantic import ValidationError

    from triptych.head.api_models import ImageEditForm, ImageGenerationRequest, VideoCreateRequest

    assert ImageGenerationRequest(prompt="x", teacache_threshold="auto").teacache_threshold == AUTO_THRESHOLD
    assert ImageEditForm(prompt="x", teacache_threshold="auto").teacache_threshold == AUTO_THRESHOLD
    assert VideoCreateRequest(prompt="x", teacache_threshold="auto").teacache_threshold == AUTO_THRESHOLD
    assert ImageGenerationRequest(prompt="x", teacache_threshold=0.3).teacache_threshold == 0.3
    for bad in ("fast", 3.0, float("inf")):
        with pytest.raises(ValidationError, match="teacache_threshold"):
            ImageGenerationRequest(prompt="x", teacache_threshold=bad)


def test_the_default_models_auto_resolves_to_its_shipped_recommendation():
    """A bare default model: ``auto`` is the shipped profile's threshold, with its forecast and cap
    (no weights loaded: the head's check)."""
    from triptych.accel.teacache_profile import ProfileIndex
    from triptych.accel.teacache_settings import TeaCacheConfig, resolve_settings
    from triptych.families.models import PACKAGED_DEFAULT

    profiles = ProfileIndex(PACKAGED_DEFAULT, "qwen-image")
    shipped = profiles(20)
    settings = resolve_settings("qwen-image", profiles, TeaCacheConfig(), AUTO_THRESHOLD, 20)
    assert settings.threshold == shipped.recommended_threshold > 0
    assert (settings.forecast, settings.max_skips, settings.warmup) == (
        shipped.forecast,
        shipped.max_skips,
        shipped.warmup,
    )
    assert settings.forecast == 1 and settings.profile == shipped.path


def test_the_video_models_auto_resolves_to_its_shipped_recommendation():
    """The packaged video model ships a profile for its 20 steps: ``auto`` is its threshold, warm-up
    and cap (the head's check, no weights)."""
    from triptych.accel.teacache_profile import ProfileIndex
    from triptych.accel.teacache_settings import TeaCacheConfig, resolve_settings
    from triptych.families.models import PACKAGED_VIDEO

    profiles = ProfileIndex(PACKAGED_VIDEO, "wan-t2v")
    shipped = profiles(20)
    assert shipped is not None and shipped.family == "wan-t2v" and shipped.target["min_motion_agreement"] == 1.0
    settings = resolve_settings("wan-t2v", profiles, TeaCacheConfig(), AUTO_THRESHOLD, 20)
    assert settings.threshold == shipped.recommended_threshold > 0 and settings.profile == shipped.path
    assert (settings.warmup, settings.max_skips, settings.forecast) == (
        shipped.warmup,
        shipped.max_skips,
        shipped.forecast,
    )


def _model_without_profiles(tmp_path):
    model = tmp_path / "my model"
    (model / "transformer").mkdir(parents=True)
    (model / "transformer" / "config.json").write_text("{}")
    return model


def test_a_model_without_a_profile_is_refused_with_the_command_that_makes_one(tmp_path):
    """The refusal names the exact ``triptych calibrate`` line, and that line parses as the command
    for this model and step count."""
    import shlex

    from triptych import cli
    from triptych.accel.teacache_profile import ProfileIndex
    from triptych.accel.teacache_settings import TeaCacheConfig, resolve_settings

    model = _model_without_profiles(tmp_path)
    profiles = ProfileIndex(model, "flux")
    command = f"triptych calibrate --model {shlex.quote(str(model))} --steps 6"
    for threshold in (AUTO_THRESHOLD, 0.1):
        with pytest.raises(InvalidParam) as err:
            resolve_settings("flux", profiles, TeaCacheConfig(), threshold, 6)
        assert err.value.field == "teacache_threshold" and "no profile found" in err.value.rule
        assert f"`{command}`" in err.value.rule
    args = cli.build_parser().parse_args(shlex.split(command)[1:])
    assert (args.command, args.model, args.steps) == ("calibrate", str(model), 6)


def test_a_profile_without_a_recommendation_is_refused_with_the_command_too(tmp_path):
    from triptych.accel.teacache_profile import ProfileIndex
    from triptych.accel.teacache_settings import TeaCacheConfig, resolve_settings

    model = _model_without_profiles(tmp_path)
    save_profile(replace(profile(), family="flux"), model / "teacache" / "flux-6steps.json")
    with pytest.raises(
        InvalidParam, match=r"has no recommended threshold\); calibrate again.*`triptych calibrate --model"
    ):
        resolve_settings("flux", ProfileIndex(model, "flux"), TeaCacheConfig(), AUTO_THRESHOLD, 6)
