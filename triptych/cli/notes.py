"""What ``triptych generate`` warns of on a resolved request, one line each on stderr: a size the
model was not trained at, words a shipped shape-world model does not know (the same notes the server
puts in a response's ``warnings``)."""

from __future__ import annotations

import sys


def warn_of_request(family, params) -> None:
    warn_untrained_size(family.model_dir, params)
    warn_unknown_words(family, params)


def warn_untrained_size(model_dir, params) -> None:
    """One line on stderr when the size is not one the model was trained at (its ``triptych.json``)."""
    from pathlib import Path

    from triptych.families.geometry import size_warning, trained_sizes

    note = size_warning(Path(model_dir).name, trained_sizes(model_dir), params.width, params.height)
    if note:
        print(f"warning: {note}", file=sys.stderr)


def warn_unknown_words(family, params) -> None:
    """One line on stderr naming the prompt's words a shipped shape-world model does not know."""
    from pathlib import Path

    from shapeworld.vocabulary import prompt_warning
    from triptych.families.geometry import model_defaults

    vocabulary = model_defaults(family.model_dir).get("prompt_normaliser")
    edit = params.image is not None and not family.is_video
    note = prompt_warning(Path(family.model_dir).name, vocabulary, params.prompt, edit)
    if note:
        print(f"warning: {note}", file=sys.stderr)
