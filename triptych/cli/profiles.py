"""Where the command line keeps TeaCache profiles of its own: a per-user directory, never the package.

``triptych calibrate`` writes to ``user_profiles_dir(model)`` (``$XDG_DATA_HOME/triptych/teacache/
<model identity>/``, default ``~/.local/share/triptych/...``) unless ``--out`` names a file; the
installed package's shipped profiles are never rewritten (``teacache_profile.save_profile`` refuses).
``generate --teacache-threshold auto``, ``quality`` and ``serve`` (its head's check and its workers,
local or remote ``triptych worker``) look in that directory first, then in the model's shipped
``teacache/`` (``find_profile``'s ``profiles_dir``). The environment is read here, in
the CLI layer; the library takes the directory as a parameter.
"""

from __future__ import annotations

import os
from pathlib import Path

from triptych.accel.teacache_profile import PACKAGE_DIR, inside_package, profiles_dir_in
from triptych.core.errors import InvalidParam


def user_data_dir() -> Path:
    """``$XDG_DATA_HOME/triptych``, default ``~/.local/share/triptych``."""
    root = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(root) / "triptych"


def user_profiles_root() -> Path:
    """``$XDG_DATA_HOME/triptych/teacache``: one directory per model identity below it. ``serve`` hands
    it to its head (``HeadConfig.teacache_profiles_root``)."""
    return user_data_dir() / "teacache"


def user_profiles_dir(model_dir: str | Path) -> Path:
    """This user's profiles of the model in ``model_dir``: one directory per model identity (the
    transformer's configs, ``PROFILED_COMPONENTS``), so two models never share a file. The one place
    every command resolves it: generate, quality, calibrate, and serve's head and workers (``triptych
    worker`` sets ``WorkerConfig.teacache_profiles_dir`` from it)."""
    return profiles_dir_in(user_profiles_root(), model_dir)


def check_out(out: str | None) -> None:
    """``calibrate --out``: not inside the installed package (checked before anything runs)."""
    if out is not None and inside_package(out):
        raise InvalidParam(
            "out",
            out,
            f"is inside the installed package ({PACKAGE_DIR}); calibrate writes a user directory "
            "(the default) or --out elsewhere, never over a shipped profile",
        )


def describe_auto(settings) -> str:
    """One line naming what ``auto`` resolved to (a ``RequestSettings``)."""
    return f"teacache auto: threshold {settings.threshold:g} from profile {settings.profile}"
