"""Which denoising steps give a preview (OpenAI's ``partial_images``): evenly spaced, never the last.

A preview is the clean image a step predicts (``Family.predict_x0``), decoded like the final latents;
it reads the step's prediction and leaves the request's latents alone, so asking for previews never
changes the final image.
"""

from __future__ import annotations

MAX_PREVIEWS = 3  # OpenAI's bound on partial_images


def preview_steps(count: int, total_steps: int) -> frozenset[int]:
    """Steps done (1-based) after which a preview is taken: ``count`` evenly spaced steps strictly
    before the last (the last step's prediction is the final image). Fewer when there are not that
    many steps: 2 previews of 4 steps come after steps 1 and 3; 3 of 20 after steps 5, 10 and 15;
    any number of 1 step, none.
    """
    assert 0 <= count <= MAX_PREVIEWS, count
    picked = {round((k + 1) * total_steps / (count + 1)) for k in range(count)}
    return frozenset(s for s in picked if 1 <= s < total_steps)
