"""``serve`` finds TeaCache profiles where ``generate`` does: a profile ``triptych calibrate`` wrote to
the user directory (``$XDG_DATA_HOME``: a temp dir, tests/conftest.py) is what ``auto`` resolves to at
the head's door and in a denoiser worker built from ``triptych worker`` flags."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from triptych import cli
from triptych.accel.teacache_profile import AUTO_THRESHOLD
from triptych.cli.profiles import user_profiles_dir
from triptych.core.errors import InvalidParam
from triptych.families.base import GenerationParams, Role
from triptych.families.registry import load_family, make_tiny
from triptych.head.admission import AdmissionLimits
from triptych.head.routes_common import resolve
from triptych.head.state import HeadConfig
from triptych.worker.runners import make_runner

STEPS = 4


@pytest.fixture(scope="module")
def calibrated_for_the_user(tmp_path_factory):
    """A tiny FLUX without profiles of its own, calibrated by the CLI into the user directory with a
    target anything meets (1.0 is recommended)."""
    model = make_tiny("flux", tmp_path_factory.mktemp("flux-user"), seed=0)
    args = ["calibrate", "--model", str(model), "--steps", str(STEPS), "--seeds", "0", "--eval-images", "2"]
    args += ["--thresholds", "1.0", "--warmup", "1", "--max-skips", "0", "--min-psnr", "0", "--min-ssim", "0"]
    assert cli.main(args) == 0
    written = user_profiles_dir(model) / f"flux-{STEPS}steps.json"
    assert written.is_file()
    return load_family(model), written


def _door(family, head_config: HeadConfig):
    """The head's check of a request's parameters (``http_common.resolve``) for one served model."""
    head = SimpleNamespace(family=family, config=head_config, limits=AdmissionLimits())
    return resolve(head, GenerationParams(prompt="x", steps=STEPS, teacache_threshold=AUTO_THRESHOLD), None)


def test_the_heads_door_accepts_auto_from_the_user_profile(calibrated_for_the_user, tmp_path):
    family, _ = calibrated_for_the_user
    args = cli.build_parser().parse_args(["serve"])
    served = args.serve_flags.head_config(args, tmp_path)
    assert _door(family, served).teacache_threshold == AUTO_THRESHOLD  # accepted (resolved by the worker)
    with pytest.raises(InvalidParam) as err:  # a head that knows only the model's own profiles refuses it
        _door(family, HeadConfig(data_dir=tmp_path))
    assert err.value.field == "teacache_threshold" and "no profile found" in err.value.rule


def test_a_worker_from_the_cli_resolves_auto_to_the_user_profile(calibrated_for_the_user):
    family, written = calibrated_for_the_user
    from triptych.cli.worker import worker_config

    argv = ["worker", "--role", "denoiser", "--head", "tcp://h:1", "--token", "a-deployment-token-for-tests"]
    config = worker_config(cli.build_parser().parse_args([*argv, "--model", str(family.model_dir)]))
    assert config.teacache_profiles_dir == written.parent
    runner = make_runner(Role.DENOISER, family, port=None, config=config)
    settings = runner.engine.accel.resolve(AUTO_THRESHOLD, STEPS)
    assert (settings.threshold, settings.profile) == (1.0, str(written))
