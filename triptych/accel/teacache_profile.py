"""TeaCache calibration profiles: the file format, its validation and where a model's profiles are found.

Calibration profiles ("TeaCache is calibrated or off": without a profile it runs only when forced). The polynomial
comes from a profile file for the family and step schedule, produced by
``triptych.calibration.fit``. Without one, a request with a threshold > 0 is refused with
``InvalidParam("teacache_threshold", ...)`` unless it brings its coefficients explicitly; nothing is
guessed. Profile file (JSON, one per family × model × steps)::

    {
      "format": "triptych.teacache.profile/3",  # /1 (no recommendation) and /2 (no forecast) still load
      "family": "flux",                  # Family.name the fit was made with
      "model": "FLUX.1-dev@<revision>",  # model name or revision the fit was made on
      "steps": 28,                       # step schedule (number of inference steps) it is valid for
      "coefficients": [a4, a3, a2, a1, a0],  # degree-4 polynomial, highest power first (numpy.polyval):
                                         # input rel-L1 -> estimated output rel-L1
      "warmup": 1,                       # first steps that always compute
      "cooldown": 1,                     # last steps that always compute
      "max_skips": 3,                    # /2: cap on consecutive skipped steps of a row (null: none)
      "forecast": 1,                     # /3: what a skipped row adds (FORECAST_ORDERS; absent: 0):
                                         # 0 the residual of its last computed step (TeaCache), 1 the
                                         # line through its last two, extrapolated in the step index
      "quality": {"points": 84, "r2": 0.97, "rmse": 0.004, "x_range": [lo, hi], ...},  # fit figures
      "recommended_threshold": 0.12,     # /2: what ``"auto"`` means (null: no threshold met the target)
      "target": {"min_psnr": 30, "min_ssim": 0.92, "max_adherence_drop": 0.02},  # /2: what it met
      "sweep": {"prompts": [...], "seeds": [...], "rows": [{"threshold": 0.1, "skipped_fraction": ...}]}
    }

``"auto"`` as a threshold (REST ``teacache_threshold: "auto"``, CLI ``--teacache-threshold auto``) is
:data:`AUTO_THRESHOLD` inside the process and on the wire; the denoiser turns it into the profile's
``recommended_threshold`` when it admits the request (``triptych.accel.teacache.resolve_settings``).

Where profiles are found (:func:`find_profile`): ``<profiles_dir>/*.json`` (an operator's directory;
entries must name the model in ``"model"``, see ``PROFILED_COMPONENTS``) first, then
``<model_dir>/teacache/*.json`` (shipped with the model; the model is implied). A profile matches on ``family`` and ``steps``.
"""

from __future__ import annotations

import json
import logging
import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from triptych.core.identity import model_identity

logger = logging.getLogger(__name__)

PROFILE_FORMAT = "triptych.teacache.profile/3"
#: NOTE: /3 only adds ``forecast``; the bump makes an older reader refuse a profile whose recommended
#: threshold was measured with a forecast, instead of serving it with plain reuse.
READABLE_FORMATS = ("triptych.teacache.profile/1", "triptych.teacache.profile/2", PROFILE_FORMAT)
#: Orders of the residual forecast of a skipped row: 0 = reuse (TeaCache), 1 = linear (TaylorSeer's
#: first order, Liu et al., https://arxiv.org/abs/2503.06923). Second order was measured and lost on
#: the default model (benchmarks/RESULTS.md, "TeaCache with a forecast residual").
FORECAST_ORDERS = (0, 1)
#: ``"auto"`` as a float: the request wants its profile's recommended threshold. Infinity because no
#: user can send it (thresholds are finite, at most ``TeaCacheConfig.max_threshold``) and it survives
#: msgpack and ``float()`` unchanged.
AUTO_THRESHOLD = math.inf
DEGREE = 4
#: What a fit depends on: a profile's ``model`` is ``model_identity(model_dir, PROFILED_COMPONENTS)``
#: (``<dir name>@<hash of the transformer's configs>``, see :mod:`triptych.core.identity`).
PROFILED_COMPONENTS = ("transformer",)


class ProfileError(ValueError):
    """A profile file that cannot be used; names the file and the field."""


@dataclass(frozen=True)
class TeaCacheProfile:
    """One calibration: family × model × steps → rescaling polynomial and its fit figures."""

    family: str
    model: str
    steps: int
    coefficients: tuple[float, ...]  # degree 4, highest power first (numpy.polyval)
    warmup: int = 1
    cooldown: int = 1
    quality: dict[str, Any] = field(default_factory=dict)
    path: str | None = None  # where it was loaded from; not written
    max_skips: int | None = None  # cap on consecutive skipped steps of one row; None = no cap
    recommended_threshold: float | None = None  # what "auto" means; None = none met the target
    target: dict[str, float] = field(default_factory=dict)  # the quality target the recommendation met
    sweep: dict[str, Any] = field(default_factory=dict)  # the threshold table it was chosen from
    forecast: int = 0  # residual of a skipped row: 0 = reuse the last computed one, 1 = linear (FORECAST_ORDERS)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "family": self.family,
            "model": self.model,
            "steps": self.steps,
            "coefficients": list(self.coefficients),
            "warmup": self.warmup,
            "cooldown": self.cooldown,
            "max_skips": self.max_skips,
            "forecast": self.forecast,
            "quality": self.quality,
            "recommended_threshold": self.recommended_threshold,
            "target": self.target,
            "sweep": self.sweep,
        }


def check_coefficients(coefficients: Sequence[float], where: str) -> tuple[float, ...]:
    try:
        coeffs = tuple(float(c) for c in coefficients)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: coefficients must be numbers ({e})") from e
    if len(coeffs) != DEGREE + 1 or not all(math.isfinite(c) for c in coeffs):
        raise ValueError(f"{where}: coefficients must be {DEGREE + 1} finite numbers (degree {DEGREE}, highest first)")
    return coeffs


def load_profile(path: str | Path) -> TeaCacheProfile:
    """Read and validate one profile file; raises ``ProfileError`` naming the file and field."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ProfileError(f"TeaCache profile {path}: unreadable ({e})") from e
    if not isinstance(data, dict) or data.get("format") not in READABLE_FORMATS:
        raise ProfileError(f"TeaCache profile {path}: 'format' must be one of {READABLE_FORMATS}")
    for key, kind in (("family", str), ("model", str), ("steps", int), ("coefficients", list)):
        if not isinstance(data.get(key), kind):
            raise ProfileError(f"TeaCache profile {path}: field {key!r} missing or not {kind.__name__}")
    try:
        coeffs = check_coefficients(data["coefficients"], f"TeaCache profile {path}")
    except (TypeError, ValueError) as e:
        raise ProfileError(str(e)) from e
    warmup, cooldown = data.get("warmup", 1), data.get("cooldown", 1)
    if data["steps"] < 1 or not isinstance(warmup, int) or not isinstance(cooldown, int) or min(warmup, cooldown) < 0:
        raise ProfileError(f"TeaCache profile {path}: steps must be >= 1, warmup/cooldown integers >= 0")
    max_skips, recommended = data.get("max_skips"), data.get("recommended_threshold")
    if max_skips is not None and (not isinstance(max_skips, int) or max_skips < 1):
        raise ProfileError(f"TeaCache profile {path}: 'max_skips' must be null or an integer >= 1")
    if recommended is not None and (
        not isinstance(recommended, (int, float)) or not math.isfinite(recommended) or recommended <= 0
    ):
        raise ProfileError(f"TeaCache profile {path}: 'recommended_threshold' must be null or a number > 0")
    forecast = data.get("forecast", 0)
    if type(forecast) is not int or forecast not in FORECAST_ORDERS:
        raise ProfileError(f"TeaCache profile {path}: 'forecast' must be one of {FORECAST_ORDERS}, got {forecast!r}")
    return TeaCacheProfile(
        family=data["family"],
        model=data["model"],
        steps=data["steps"],
        coefficients=coeffs,
        warmup=warmup,
        cooldown=cooldown,
        quality=dict(data.get("quality", {})),
        path=str(path),
        max_skips=max_skips,
        recommended_threshold=None if recommended is None else float(recommended),
        target=dict(data.get("target") or {}),
        sweep=dict(data.get("sweep") or {}),
        forecast=forecast,
    )


#: The installed ``triptych`` package: its shipped profiles are read, never rewritten.
PACKAGE_DIR = Path(__file__).resolve().parents[1]


def inside_package(path: str | Path) -> bool:
    """Whether ``path`` lies inside the installed ``triptych`` package (``PACKAGE_DIR``)."""
    return Path(path).resolve().is_relative_to(PACKAGE_DIR)


def save_profile(profile: TeaCacheProfile, path: str | Path) -> Path:
    """Write ``profile`` to ``path``; refuses (``ProfileError``) a path inside the installed package,
    so a calibration never rewrites a shipped profile (copy one there by hand to ship it)."""
    path = Path(path)
    if inside_package(path):
        raise ProfileError(f"TeaCache profile {path}: inside the installed package {PACKAGE_DIR}; write it elsewhere")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_json(), indent=2) + "\n")
    return path


def profile_filename(family: str, steps: int) -> str:
    return f"{family}-{steps}steps.json"


def profiles_dir_in(root: str | Path, model_dir: str | Path) -> Path:
    """The model's directory under a profiles root: ``<root>/<model identity>/`` (its transformer's
    configs, ``PROFILED_COMPONENTS``), so two models never share a file. The CLI's root is the user's
    (``cli_profiles``); serve hands it to its head (``HeadConfig.teacache_profiles_root``)."""
    return Path(root) / model_identity(model_dir, PROFILED_COMPONENTS)


def find_profile(
    model_dir: str | Path,
    steps: int,
    family: str | None = None,
    profiles_dir: str | Path | None = None,
    model: str | None = None,
) -> TeaCacheProfile | None:
    """The profile for ``(family, steps)`` of the model in ``model_dir``, or None.

    ``profiles_dir`` entries must also name the model (``model``, default the transformer's
    ``model_identity``, see ``PROFILED_COMPONENTS``);
    ``<model_dir>/teacache/`` entries belong to that model by location. Broken files raise.
    """
    model = model or model_identity(model_dir, PROFILED_COMPONENTS)
    places = [(Path(profiles_dir), True)] if profiles_dir is not None else []
    places.append((Path(model_dir) / "teacache", False))
    for directory, must_name_model in places:
        if not directory.is_dir():
            continue
        found = [
            p
            for p in (load_profile(f) for f in sorted(directory.glob("*.json")))
            if p.steps == steps and (family is None or p.family == family) and (not must_name_model or p.model == model)
        ]
        if len(found) > 1:
            logger.warning(
                "several TeaCache profiles match %s/%s steps in %s; using %s", family, steps, directory, found[0].path
            )
        if found:
            return found[0]
    return None


def calibrate_command(model_dir: str | Path | None, steps: int) -> str:
    """The command line that makes the missing profile of ``model_dir`` at ``steps`` (where ``auto``
    then finds it: the user's profiles directory); without a model, the built-in one's."""
    model = f" --model {shlex.quote(str(model_dir))}" if model_dir is not None else ""
    return f"triptych calibrate{model} --steps {steps}"


class ProfileIndex:
    """``steps -> profile`` for one loaded model (memoised :func:`find_profile`); the TeaCache's source."""

    def __init__(
        self, model_dir: str | Path, family: str, profiles_dir: str | Path | None = None, model: str | None = None
    ):
        self.model_dir, self.family, self.profiles_dir, self.model = model_dir, family, profiles_dir, model
        self._cache: dict[int, TeaCacheProfile | None] = {}

    def __call__(self, steps: int) -> TeaCacheProfile | None:
        if steps not in self._cache:
            self._cache[steps] = find_profile(self.model_dir, steps, self.family, self.profiles_dir, self.model)
        return self._cache[steps]

    def command(self, steps: int) -> str:
        """What makes this model's profile at ``steps`` (:func:`calibrate_command`)."""
        return calibrate_command(self.model_dir, steps)
