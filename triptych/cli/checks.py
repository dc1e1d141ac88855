"""What the command line checks before it imports torch: paths, images, numbers, output formats.

``triptych.cli.main`` runs a command's ``check`` (set as a parser default) right after parsing, so a
bad argument is one ``error: invalid ...`` line and exit code 2 at once, not after the
torch/diffusers import. Nothing here imports torch (PIL and
numpy only, for images); what needs the weights (sizes a family accepts, a profile's steps) is still
checked by the command after loading.
"""

from __future__ import annotations

import math
from pathlib import Path

from triptych.core.devices import check_threads
from triptych.core.errors import InvalidParam


def read_image(path: str, field: str = "image"):
    """The RGB image in the file at ``path``; ``InvalidParam`` naming the path when it is missing,
    unreadable or not a decodable image."""
    from triptych.core.media import decode_image

    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise InvalidParam(field, path, "file does not exist") from None
    except OSError as e:
        raise InvalidParam(field, path, f"cannot be read ({e.strerror or e})") from None
    try:
        return decode_image(data, field=field)
    except InvalidParam as e:
        if e.rule.startswith("not a decodable"):
            raise InvalidParam(field, path, f"is not a decodable PNG/JPEG/WebP image ({len(data)} bytes)") from None
        raise InvalidParam(field, path, f"{e.rule} (it has {e.value})") from None


def at_least(field: str, value, low: float) -> None:
    """``value`` (None: not given) must be a finite number >= ``low``."""
    if value is not None and not (math.isfinite(value) and value >= low):
        raise InvalidParam(field, value, f"must be >= {low:g}")


def check_model(args) -> None:
    if args.model is not None and not Path(args.model).is_dir():
        raise InvalidParam("model", args.model, "is not a directory (a diffusers model directory)")


def check_common(args) -> None:
    """Flags every in-process command has: ``--model``, ``--threads``."""
    check_model(args)
    check_threads(args.threads)


def check_parallel(args) -> None:
    for name in ("cfg_parallel", "ulysses", "ring"):
        at_least(name, getattr(args, name), 1)
    if args.cfg_parallel > 2:
        raise InvalidParam("cfg_parallel", args.cfg_parallel, "must be 1 or 2")


def check_generate(args) -> None:
    """``triptych generate``: the output format, the condition image (decoded into ``args.image_rgb``)
    and every number's range."""
    from triptych.core.media import format_for_path

    check_common(args)
    args.out_format = format_for_path(args.out)
    for name in ("height", "width", "frames", "steps", "fps"):
        at_least(name, getattr(args, name), 1)
    at_least("mm_cache_mb", args.mm_cache_mb, 0)
    check_parallel(args)
    from triptych.cli.limits import check_args

    check_args(args)  # the server's size, step and frame limits, unless --no-limits
    args.image_rgb = read_image(args.image) if args.image else None


def check_chat(args) -> None:
    check_common(args)
    at_least("max_tokens", args.max_tokens, 1)
    at_least("temperature", args.temperature, 0)
    at_least("mm_cache_mb", args.mm_cache_mb, 0)
    if not 0 < args.top_p <= 1:
        raise InvalidParam("top_p", args.top_p, "must be in (0, 1]")
    args.images_rgb = [read_image(path, f"image[{i}]") for i, path in enumerate(args.image)]
