"""TeaCache profile files: round trip, validation, lookup order; the polynomial fit."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from triptych.accel.teacache_profile import (
    PROFILE_FORMAT,
    PROFILED_COMPONENTS,
    ProfileError,
    ProfileIndex,
    TeaCacheProfile,
    find_profile,
    load_profile,
    save_profile,
)
from triptych.calibration.fit import fit_coefficients
from triptych.core.identity import model_identity

COEFFS = (1.0, -2.0, 3.0, 0.5, 0.01)


def prof(steps=8, model="m", family="flux"):
    return TeaCacheProfile(family, model, steps, COEFFS, 2, 1, {"r2": 0.9})


def test_round_trip(tmp_path):
    path = save_profile(prof(), tmp_path / "p.json")
    loaded = load_profile(path)
    assert loaded.coefficients == COEFFS and loaded.steps == 8 and (loaded.warmup, loaded.cooldown) == (2, 1)
    assert loaded.quality == {"r2": 0.9} and loaded.path == str(path)


def test_forecast_round_trips_and_defaults_to_reuse(tmp_path):
    again = load_profile(save_profile(replace(prof(), forecast=1), tmp_path / "f.json"))
    assert again.forecast == 1
    data = prof().to_json()
    data["format"] = "triptych.teacache.profile/2"  # written before the field existed
    del data["forecast"]
    (tmp_path / "v2.json").write_text(json.dumps(data))
    assert load_profile(tmp_path / "v2.json").forecast == 0


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"format": "other"}, "format"),
        ({"coefficients": [1, 2]}, "coefficients"),
        ({"steps": "8"}, "steps"),
        ({"coefficients": [1, 2, 3, 4, "x"]}, "coefficients"),
        ({"warmup": -1}, "warmup"),
        ({"forecast": 2}, "forecast"),
        ({"forecast": True}, "forecast"),
    ],
)
def test_invalid_files_name_the_problem(tmp_path, patch, field):
    data = {**prof().to_json(), **patch}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=field):
        load_profile(path)


def test_unreadable_file(tmp_path):
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ProfileError, match="unreadable"):
        load_profile(tmp_path / "x.json")


def test_find_in_model_dir_matches_family_and_steps(tmp_path):
    model = tmp_path / "model"
    save_profile(prof(steps=8), model / "teacache" / "a.json")
    save_profile(prof(steps=28), model / "teacache" / "b.json")
    assert find_profile(model, 28, "flux").steps == 28
    assert find_profile(model, 8, "wan") is None
    assert find_profile(model, 4, "flux") is None


def test_profiles_dir_first_and_must_name_the_model(tmp_path):
    model, extra = tmp_path / "model", tmp_path / "profiles"
    save_profile(prof(), model / "teacache" / "shipped.json")
    save_profile(TeaCacheProfile("flux", "other-model", 8, (0, 0, 0, 1, 0)), extra / "x.json")
    assert find_profile(model, 8, "flux", extra).path.endswith("shipped.json")  # other model's profile ignored
    save_profile(
        TeaCacheProfile("flux", model_identity(model, PROFILED_COMPONENTS), 8, (0, 0, 0, 1, 0)), extra / "y.json"
    )
    assert find_profile(model, 8, "flux", extra).path.endswith("y.json")
    assert find_profile(model, 8, "flux", extra, model="renamed").path.endswith("shipped.json")


def test_profiles_name_the_model_by_its_transformer_configs(tmp_path):
    a, b = tmp_path / "m", tmp_path / "n" / "m"
    for d, layers in ((a, 1), (b, 2)):
        (d / "transformer").mkdir(parents=True)
        (d / "transformer" / "config.json").write_text(json.dumps({"num_layers": layers}))
    save_profile(TeaCacheProfile("flux", model_identity(a, PROFILED_COMPONENTS), 8, COEFFS), tmp_path / "p" / "a.json")
    assert model_identity(a, PROFILED_COMPONENTS).startswith("m@")
    assert find_profile(a, 8, "flux", tmp_path / "p") is not None and find_profile(b, 8, "flux", tmp_path / "p") is None


def test_index_memoises(tmp_path):
    model = tmp_path / "model"
    index = ProfileIndex(model, "flux")
    assert index(8) is None
    save_profile(prof(), model / "teacache" / "a.json")
    assert index(8) is None  # looked up once per steps (restart to pick up new files)
    assert ProfileIndex(model, "flux")(8).steps == 8


def test_format_constant_is_written(tmp_path):
    assert json.loads(save_profile(prof(), tmp_path / "p.json").read_text())["format"] == PROFILE_FORMAT


def test_fit_recovers_a_known_polynomial():
    x = np.linspace(0.01, 0.3, 40)
    y = np.polyval(COEFFS, x)
    coeffs, quality = fit_coefficients(x, y)
    assert np.allclose(coeffs, COEFFS, atol=1e-6) and quality["r2"] > 0.999999 and quality["points"] == 40


def test_fit_needs_enough_points():
    with pytest.raises(ValueError, match="at least 5"):
        fit_coefficients([0.1, 0.2, 0.3], [0.1, 0.2, 0.3])
