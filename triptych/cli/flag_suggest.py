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
