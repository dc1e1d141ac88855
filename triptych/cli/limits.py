"""``triptych generate`` holds a request to the server's admission limits (``AdmissionLimits``, its
defaults: what ``triptych serve`` refuses, this refuses), unless ``--no-limits`` lifts them knowingly.

The checks are the head's own (``AdmissionLimits.check_*``); only the field names are the command's
(``--steps`` for the API's ``num_inference_steps``). ``check_args`` runs before torch is imported, on
what the flags say; ``check_resolved`` after the model filled its defaults.
"""

from __future__ import annotations

from triptych.core.errors import InvalidParam
from triptych.head.admission import AdmissionLimits

LIFT = "--no-limits lifts the server's limits"
#: the API field a limit names → the command's flag for it
CLI_FIELD = {"num_inference_steps": "steps", "size": "size"}


def _checked(check, *args) -> None:
    try:
        check(*args)
    except InvalidParam as e:
        raise InvalidParam(CLI_FIELD.get(e.field, e.field), e.value, f"{e.rule} ({LIFT})") from None


def check_args(args, limits: AdmissionLimits | None = None) -> None:
    """The flags' own size, steps and frames against the limits (nothing when ``--no-limits``)."""
    if args.no_limits:
        return
    lim = limits or AdmissionLimits()
    _checked(lim.check_steps, args.steps)
    _checked(lim.check_frames, args.frames)
    if args.height is not None and args.width is not None:
        _checked(lim.parse_size, f"{args.width}x{args.height}")


def check_resolved(family, params, no_limits: bool, limits: AdmissionLimits | None = None) -> None:
    """The resolved request (the model's defaults filled in) as the head checks it: pixels, frames,
    steps and the model's transformer tokens."""
    if no_limits:
        return
    lim = limits or AdmissionLimits()
    _checked(lim.check_resolved, params.width, params.height, params.frames, params.steps)
    frames = f", {params.frames} frames" if family.is_video else ""
    _checked(lim.check_tokens, family.sequence_tokens(params), f"{params.width}x{params.height}{frames}")
