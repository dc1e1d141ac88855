"""Admission: the limits the head enforces before a request reaches a backend.

``AdmissionLimits`` is the one config object for them; every check raises ``InvalidParam`` naming the
API field, the value and the limit (→ HTTP 400), or ``Overloaded`` (→ HTTP 429 + Retry-After).
``Admission`` counts the generation jobs the head has accepted and not yet finished (queued or
running, images and videos alike) and refuses new ones past ``max_queued_requests``.

NOTE: importing this module does not import torch, so the CLI and config code can read the limits
without it; ``Overloaded`` lives in ``backend``, whose edge types do, so it is imported where it is
raised (the refusal path only).
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from dataclasses import dataclass, fields

from triptych.core.errors import InvalidParam
from triptych.core.media import ImageLimits
from triptych.core.video_input import VideoLimits

_SIZE_RE = re.compile(r"^\s*([0-9]{1,9})\s*[xX×]\s*([0-9]{1,9})\s*$")  # ASCII digits only


@dataclass(frozen=True)
class AdmissionLimits:
    """Per-request and head-wide limits. Bounds are checked on construction (``ValueError``)."""

    max_pixels: int = 2048 * 2048
    """Largest output width × height. Bounds: >= 1."""

    max_tokens: int = 32_768
    """Most transformer tokens of one request, counted with the model's own geometry (latent patches ×
    latent frames, plus an edit's condition tokens): the denoiser's cost grows with it (attention with
    its square), so one cap means the same cost on every model, where max_pixels does not (2048² is
    16,384 tokens for FLUX or Qwen-Image, 4,096 for a 32-px-per-token model). Bounds: >= 1."""

    max_frames: int = 161
    """Most frames of a video (``frames``, or ``seconds`` × fps). Bounds: >= 1."""

    max_steps: int = 100
    """Most denoising steps (``num_inference_steps``). Bounds: >= 1."""

    max_n: int = 10
    """Most images per request (``n``; OpenAI's range is 1-10); each image is one job, admitted
    together against max_queued_requests. Bounds: 1..max_queued_requests."""

    max_prompt_chars: int = 20_000
    """Longest ``prompt`` / ``negative_prompt`` in characters. Bounds: >= 1."""

    max_upload_bytes: int = 20 * 1024 * 1024
    """Largest uploaded image (edits, image-to-video) in bytes; checked before decoding. Bounds: >= 1."""

    max_upload_pixels: int = 4096 * 4096
    """Largest uploaded image in pixels, read from the header before a full decode. Bounds: >= 1."""

    max_chat_tokens: int = 2048
    """Most tokens a chat answer may have (``max_tokens`` / ``max_completion_tokens``). Bounds: >= 1."""

    max_chat_images: int = 8
    """Most images in one chat request (a video part counts one). Bounds: >= 1."""

    max_chat_video_bytes: int = 32 * 1024 * 1024
    """Largest video clip of a chat ``video_url`` part in bytes; checked before decoding. Bounds: >= 1."""

    max_chat_video_pixels: int = 1920 * 1080
    """Largest frame (width x height) of a chat video clip, read from its header. Bounds: >= 1."""

    max_chat_video_frames: int = 16
    """Most frames sampled from one chat video clip (a part's ``max_frames`` may not exceed it; a
    longer clip is sampled uniformly). Bounds: >= 1."""

    max_queued_requests: int = 64
    """Jobs accepted and not yet finished (queued + running) before new ones get 429. Bounds: >= 1."""

    retry_after_s: float = 1.0
    """Retry-After hint sent with a 429. Bounds: > 0."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"AdmissionLimits.{f.name}={value!r}: must be a positive number")
            if f.type == "int" and not isinstance(value, int):
                raise ValueError(f"AdmissionLimits.{f.name}={value!r}: must be an integer")
        if self.max_n > self.max_queued_requests:
            raise ValueError(
                f"AdmissionLimits.max_n={self.max_n} exceeds max_queued_requests={self.max_queued_requests}: "
                "a request of n images could never be admitted; lower max_n or raise max_queued_requests"
            )

    @property
    def image_limits(self) -> ImageLimits:
        return ImageLimits(max_bytes=self.max_upload_bytes, max_pixels=self.max_upload_pixels)

    @property
    def video_limits(self) -> VideoLimits:
        return VideoLimits(
            max_bytes=self.max_chat_video_bytes,
            max_pixels=self.max_chat_video_pixels,
            max_frames=self.max_chat_video_frames,
        )

    # ---- per-request checks --------------------------------------------------------------
    def parse_size(self, size: str | None, field: str = "size") -> tuple[int | None, int | None]:
        """``"WxH"`` → (width, height); ``None``/``"auto"`` → (None, None) for the model's default."""
        if size is None or size == "auto":
            return None, None
        m = _SIZE_RE.match(size) if isinstance(size, str) else None
        if m is None:
            raise InvalidParam(field, size, 'must be "WIDTHxHEIGHT" with positive integers (e.g. "512x512") or "auto"')
        w, h = int(m.group(1)), int(m.group(2))
        if w < 1 or h < 1:
            raise InvalidParam(field, size, "width and height must be >= 1")
        if w * h > self.max_pixels:
            raise InvalidParam(field, size, f"width x height = {w * h} pixels exceeds the limit of {self.max_pixels}")
        return w, h

    def check_n(self, n: int) -> None:
        if not 1 <= n <= self.max_n:
            raise InvalidParam("n", n, f"must be between 1 and {self.max_n} (the server's max_n)")

    def check_steps(self, steps: int | None, field: str = "num_inference_steps") -> None:
        if steps is not None and not 1 <= steps <= self.max_steps:
            raise InvalidParam(field, steps, f"must be between 1 and {self.max_steps}")

    def check_frames(self, frames: int | None, field: str = "frames") -> None:
        if frames is not None and not 1 <= frames <= self.max_frames:
            raise InvalidParam(field, frames, f"must be between 1 and {self.max_frames} frames")

    def check_prompt(self, text: str | None, field: str = "prompt") -> None:
        if text is not None and len(text) > self.max_prompt_chars:
            limit = self.max_prompt_chars
            raise InvalidParam(field, f"<{len(text)} characters>", f"must be at most {limit} characters")

    def check_resolved(self, width: int, height: int, frames: int | None, steps: int) -> None:
        """Re-check after the family filled its defaults (a model's default may exceed a head limit)."""
        if width * height > self.max_pixels:
            raise InvalidParam("size", f"{width}x{height}", f"exceeds the limit of {self.max_pixels} pixels")
        self.check_frames(frames)
        self.check_steps(steps)

    def check_tokens(self, tokens: int, shown: str) -> None:
        """``tokens``: the request's transformer tokens (``Family.sequence_tokens``); ``shown``: its
        size (and frames) as the client gave them."""
        if tokens > self.max_tokens:
            raise InvalidParam(
                "size", shown, f"is {tokens} transformer tokens for this model, over the limit of {self.max_tokens}"
            )


class Admission:
    """Counts accepted, unfinished jobs; ``admit(k)`` reserves k of them for the ``with`` block.

    Owned by one head (one event loop); not thread-safe by design: only coroutines on the loop call it.
    """

    def __init__(self, limits: AdmissionLimits):
        self.limits = limits
        self.in_flight = 0

    def reserve(self, k: int = 1) -> None:
        if self.in_flight + k > self.limits.max_queued_requests:
            from triptych.control.backend import Overloaded

            raise Overloaded(
                f"too many queued requests ({self.in_flight} in flight, limit max_queued_requests="
                f"{self.limits.max_queued_requests}); retry later",
                retry_after=self.limits.retry_after_s,
            )
        self.in_flight += k

    def release(self, k: int = 1) -> None:
        assert self.in_flight >= k, "released more jobs than were admitted"
        self.in_flight -= k

    @contextmanager
    def admit(self, k: int = 1):
        self.reserve(k)
        try:
            yield
        finally:
            self.release(k)


def retry_after_header(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))
