"""A generation's progress as one number, 0..100, the same for ``GET /v1/videos/{id}`` (OpenAI's
``progress``) and ``triptych generate``'s bar: denoising steps fill the first 90 points (steps done /
total x 90), the decode (VAE and media encoding) the last 10, reached when the output exists."""

from __future__ import annotations

DENOISE_SHARE = 90  # points of 100 the denoising steps fill; the decode takes the rest
DONE = 100


def progress_percent(steps_done: int, total_steps: int) -> int:
    """Progress after ``steps_done`` of ``total_steps`` steps: 0..90 (90 = decoding)."""
    return max(0, min(DENOISE_SHARE, steps_done * DENOISE_SHARE // max(total_steps, 1)))
