"""Errors that cross the user boundary.

``InvalidParam`` is raised wherever user input is checked (CLI, REST, stage validation). It names the
field, the value and the rule, so the CLI prints it as one line (exit code 2) and the REST layer
turns it into an OpenAI-style 400 without a stack trace.
"""

from __future__ import annotations

from typing import Any

#: Longest part of a user's value echoed in an error message; the rest is summarised by its length.
ECHO_CHARS = 64


def shown(value: Any, limit: int = ECHO_CHARS) -> str:
    """``repr(value)`` for an error message, cut to its first ``limit`` characters plus
    ``…(N chars)`` when longer: a 10,000-character id is not echoed whole."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}…({len(value)} chars)"
    text = repr(value)
    return text if len(text) <= limit + 16 else f"{text[:limit]}…({len(text)} chars)"


def shown_name(name: str, limit: int = ECHO_CHARS) -> str:
    """A field name as echoed (a client's unknown key can be any length): cut like ``shown``."""
    return name if len(name) <= limit else f"{name[:limit]}…({len(name)} chars)"


class TriptychError(Exception):
    """Base class of errors Triptych raises on purpose."""


class InvalidParam(TriptychError, ValueError):
    """A user-supplied value broke a rule.

    Attributes:
        field: the request field (CLI flag names map to the same field names).
        value: the offending value, as given (messages echo it cut by ``shown``).
        rule: the limit or rule it broke, phrased so the user can fix the request.
    """

    def __init__(self, field: str, value: Any, rule: str):
        self.field = field
        self.value = value
        self.rule = rule
        super().__init__(f"invalid {shown_name(field)}={shown(value)}: {rule}")


class UnknownModel(TriptychError, ValueError):
    """A model directory that no registered family can load."""

    def __init__(self, path: str, reason: str, supported: list[str]):
        self.path = path
        self.supported = supported
        super().__init__(f"cannot load model at {path!r}: {reason}; supported families: {', '.join(supported)}")
