"""Media in and out: encode decoded frames to PNG/JPEG/WebP/MP4; decode uploaded images safely.

Uploads are checked before a full decode: byte size first, then the header's pixel count (PIL reads
only the header on ``open``), then the decode itself under PIL's decompression-bomb guard.
"""

from __future__ import annotations

import io
import logging
import os
import tempfile
import warnings
from dataclasses import dataclass

import numpy as np

from triptych.core.errors import InvalidParam

logger = logging.getLogger(__name__)

IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP"}
VIDEO_FORMATS = {"mp4"}
MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "jpg": "image/jpeg", "webp": "image/webp", "mp4": "video/mp4"}


def format_for_path(path: str) -> str:
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if ext not in IMAGE_FORMATS and ext not in VIDEO_FORMATS:
        raise InvalidParam("out", path, "extension must be one of .png, .jpg, .jpeg, .webp, .mp4")
    return ext


DEFAULT_QUALITY = 95  # jpeg/webp quality when a request names none


def encode_image(frame_uint8: np.ndarray, fmt: str, quality: int | None = None) -> bytes:
    from PIL import Image

    if fmt not in IMAGE_FORMATS:
        raise InvalidParam("output_format", fmt, f"must be one of {sorted(IMAGE_FORMATS)}")
    buf = io.BytesIO()
    lossy = IMAGE_FORMATS[fmt] in ("JPEG", "WEBP")
    if quality is not None and not lossy:
        raise InvalidParam("output_compression", quality, "applies to jpeg and webp only (png is lossless)")
    if quality is not None and not 0 <= quality <= 100:
        raise InvalidParam("output_compression", quality, "must be between 0 and 100")
    kwargs = {"quality": DEFAULT_QUALITY if quality is None else quality} if lossy else {}
    Image.fromarray(frame_uint8).save(buf, format=IMAGE_FORMATS[fmt], **kwargs)
    return buf.getvalue()


def encode_video(frames_uint8: np.ndarray, fps: int = 16) -> bytes:
    """H.264 MP4 through imageio-ffmpeg (its ffmpeg binary ships in the wheel); deterministic."""
    import imageio.v2 as imageio

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.mp4")
        # macro_block_size=1 keeps tiny sizes (e.g. 32×48) without resizing.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with imageio.get_writer(
                path,
                fps=fps,
                codec="libx264",
                macro_block_size=1,
                quality=8,
                ffmpeg_log_level="error",
                output_params=["-pix_fmt", "yuv420p"],
            ) as w:
                for f in frames_uint8:
                    w.append_data(f)
        with open(path, "rb") as f:
            return f.read()


def encode_frames(frames_uint8: np.ndarray, fmt: str, fps: int = 16, quality: int | None = None) -> bytes:
    """frames (F, H, W, 3) uint8 → bytes; ``mp4`` for video, one image format for a single frame;
    ``quality``: jpeg/webp quality (OpenAI's ``output_compression``), None for the default."""
    if fmt in VIDEO_FORMATS:
        return encode_video(frames_uint8, fps=fps)
    if frames_uint8.shape[0] != 1:
        raise InvalidParam("output_format", fmt, "a video needs mp4")
    return encode_image(frames_uint8[0], fmt, quality)


@dataclass(frozen=True)
class ImageLimits:
    """Upload limits checked before a full decode."""

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 4096 * 4096


def decode_image(data: bytes, limits: ImageLimits = ImageLimits(), field: str = "image"):
    """Bytes → RGB PIL image, refusing oversize, bomb-sized or corrupt input with ``InvalidParam``."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise InvalidParam(field, f"<{len(data)} bytes>", f"upload must be at most {limits.max_bytes} bytes")
    if not data:
        raise InvalidParam(field, "<0 bytes>", "upload is empty")
    try:
        with Image.open(io.BytesIO(data)) as probe:  # reads the header only
            w, h = probe.size
            if w * h > limits.max_pixels:
                raise InvalidParam(field, f"<{w}x{h}>", f"image must have at most {limits.max_pixels} pixels")
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                probe.load()
            return probe.convert("RGB")
    except InvalidParam:
        raise
    except (
        UnidentifiedImageError,
        OSError,
        SyntaxError,
        ValueError,
        Image.DecompressionBombError,
        Image.DecompressionBombWarning,
    ) as e:
        raise InvalidParam(field, f"<{len(data)} bytes>", f"not a decodable PNG/JPEG/WebP image ({e})") from e


def decode_data_url(url: str, limits: ImageLimits, field: str):
    """A base64 ``data:`` URL → decoded RGB image (same limits as an upload). Nothing is ever fetched:
    a remote URL is refused, so the head cannot be pointed at internal addresses."""
    return decode_image(data_url_bytes(url, field), limits, field)


def data_url_bytes(url: str, field: str) -> bytes:
    """A base64 ``data:`` URL → its bytes (any media type); a remote URL or bad base64 is refused."""
    import binascii

    if not url.startswith("data:") or ";base64," not in url[:200]:
        raise InvalidParam(field, url[:40], "must be a base64 data: URL (the server fetches nothing)")
    try:
        return _b64decode(url[url.index(",") + 1 :])
    except (binascii.Error, ValueError) as e:
        raise InvalidParam(field, url[:40], f"invalid base64 ({e})") from None


_B64_CHUNK = 1 << 20  # characters (a multiple of 4) per decode call


def _b64decode(text: str) -> bytes:
    """``base64.b64decode(text, validate=True)`` in 1 MiB pieces: the decoder holds the GIL for a whole
    call, so a thread decoding one large data URL would stall the event loop that
    long; between pieces it can run."""
    import base64

    if len(text) <= _B64_CHUNK:
        return base64.b64decode(text, validate=True)
    if text.find("=", 0, len(text) - 2) != -1:
        raise ValueError("padding before the end of the data")
    return b"".join(base64.b64decode(text[i : i + _B64_CHUNK], validate=True) for i in range(0, len(text), _B64_CHUNK))
