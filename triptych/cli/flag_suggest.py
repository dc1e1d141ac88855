"""A misspelt flag named with its closest match (``--promt`` → ``--prompt``), as argparse's
``suggest_on_error`` does from Python 3.14 on; this is the same idea for older Pythons, with difflib."""

from __future__ import annotations

import argparse
import difflib


def flag_options(parser: argparse.ArgumentParser) -> list[str]:
    """The long and short option strings ``parser`` takes."""
    return [opt for action in parser._actions for opt in action.option_strings]


def unknown_flags_message(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """argparse's "unrecognized arguments" line, each unknown flag followed by its closest match
    (``--promt (did you mean --prompt?)``) where one is close enough."""
    options = flag_options(parser)
    shown = []
    for token in unknown:
        flag = token.split("=", 1)[0]
        close = difflib.get_close_matches(flag, options, n=1, cutoff=0.7) if flag.startswith("-") else []
        shown.append(f"{token} (did you mean {close[0]}?)" if close else token)
    return f"unrecognized arguments: {' '.join(shown)}"


def name_misspelt_flags(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Make each subcommand's errors name a misspelt flag of ``argv`` with its closest match even
    when another error comes first (``--promt x`` leaves the required ``--prompt`` missing, which
    argparse reports alone). Set on the parser objects (their ``error``), not by subclassing."""
    for action in parser._actions:
        for sub in (
            (getattr(action, "choices", None) or {}).values() if isinstance(action, argparse._SubParsersAction) else ()
        ):
            sub.error = _error_naming_flags(sub, argv, set(flag_options(parser)))


def _error_naming_flags(parser: argparse.ArgumentParser, argv: list[str], top: set[str]):
    plain = parser.error

    def error(message: str):
        options = set(flag_options(parser)) | top
        flags = [t for t in argv if t.startswith("--") and t.split("=", 1)[0] not in options]
        unknown = [t for t in flags if not any(o.startswith(t.split("=", 1)[0]) for o in options)]  # no abbreviation
        if unknown and "unrecognized arguments" not in message:
            message = f"{unknown_flags_message(parser, unknown)}; {message}"
        plain(message)

    return error
