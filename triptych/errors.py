"""Errors that cross the user boundary.

``InvalidParam`` is raised wherever user input is checked (CLI, REST, stage validation). It names the
field, the value and the rule, so the CLI prints it as one line (exit code 2) and the REST layer
turns it into an OpenAI-style 400 without a stack trace.
"""

from __future__ import annotations

from typing import Any


class TriptychError(Exception):
    """Base class of errors Triptych raises on purpose."""


class InvalidParam(TriptychError, ValueError):
    """A user-supplied value broke a rule.

    Attributes:
        field: the request field (CLI flag names map to the same field names).
        value: the offending value, as given.
        rule: the limit or rule it broke, phrased so the user can fix the request.
    """

    def __init__(self, field: str, value: Any, rule: str):
        self.field = field
        self.value = value
        self.rule = rule
        super().__init__(f"invalid {field}={value!r}: {rule}")


class UnknownModel(TriptychError, ValueError):
    """A model directory that no registered family can load."""

    def __init__(self, path: str, reason: str, supported: list[str]):
        self.path = path
        self.supported = supported
        super().__init__(f"cannot load model at {path!r}: {reason}; supported families: {', '.join(supported)}")
