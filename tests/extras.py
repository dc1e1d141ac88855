"""Optional extras a test may need, and the one marker that says so.

``needs_extra("quant")`` marks a test (or, as ``pytestmark``, a module) that needs an extra the
README's plain ``./install.sh`` does not bring. Where the extra is missing the test is skipped with a
reason naming the extra and its install command, unless the run requires it: ``TRIPTYCH_REQUIRE_EXTRAS``
(comma-separated names, or ``all``) turns that skip into a failure, so a CI phase that installed an
extra cannot hide a broken install behind skips. ``--only-extras=quant,vllm`` (conftest) keeps just the
tests marked with those extras: the second CI phase runs them after installing them.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
REQUIRE_ENV = "TRIPTYCH_REQUIRE_EXTRAS"


def _module(name: str) -> Callable[[], bool]:
    return lambda: importlib.util.find_spec(name) is not None


def _mooncake() -> bool:
    from triptych.transfer import mooncake_available

    return mooncake_available()


def _chromium() -> bool:
    return chromium() is not None


def chromium() -> str | None:
    """The headless Chromium binary, or None."""
    return next((p for p in ("/usr/bin/chromium", shutil.which("chromium") or "") if p and os.path.exists(p)), None)


@dataclass(frozen=True)
class Extra:
    name: str
    present: Callable[[], bool]
    install: str  # what brings it

    def reason(self) -> str:
        return f"needs the {self.name} extra, not installed here: {self.install}"


EXTRAS = {
    e.name: e
    for e in (
        Extra("quant", _module("torchao"), "./install.sh --quant (torchao)"),
        Extra("vllm", VLLM_PYTHON.is_file, "./install.sh --vllm (vLLM in .venv-vllm)"),
        Extra("ray", _module("ray"), "pip install -e '.[ray]' (./install.sh installs it)"),
        Extra(
            "mooncake",
            _mooncake,
            "pip install -e '.[mooncake]' and apt-get install -y libibverbs1 (./install.sh does both as root)",
        ),
        Extra("chromium", _chromium, "apt-get install -y chromium (./install.sh does it as root)"),
    )
}


def needs_extra(name: str) -> pytest.MarkDecorator:
    """The marker of a test that needs extra ``name`` (a key of ``EXTRAS``)."""
    if name not in EXTRAS:
        raise KeyError(f"unknown extra {name!r}; known: {sorted(EXTRAS)}")
    return pytest.mark.extra(name)


def required() -> frozenset[str]:
    """The extras this run must have (``TRIPTYCH_REQUIRE_EXTRAS``)."""
    names = {n.strip() for n in os.environ.get(REQUIRE_ENV, "").split(",") if n.strip()}
    if "all" in names:
        return frozenset(EXTRAS)
    unknown = names - set(EXTRAS)
    if unknown:
        raise pytest.UsageError(f"{REQUIRE_ENV}: unknown extras {sorted(unknown)}; known: {sorted(EXTRAS)}")
    return frozenset(names)


@functools.cache
def missing(name: str) -> bool:
    return not EXTRAS[name].present()


def module_needs(name: str) -> pytest.MarkDecorator:
    """For a test module whose imports need extra ``name``: call it before those imports and assign
    it to ``pytestmark``. Where the extra is missing the whole module is skipped naming it (or fails
    to collect when the run requires it)."""
    if missing(name):
        if name in required():
            raise pytest.UsageError(f"{REQUIRE_ENV} requires it, but this module {EXTRAS[name].reason()}")
        pytest.skip(EXTRAS[name].reason(), allow_module_level=True)
    return needs_extra(name)
