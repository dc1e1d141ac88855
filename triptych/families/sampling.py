"""Per-request sampler state for flow-matching families (FLUX, Qwen-Image).

Uses the pipelines' own ``calculate_shift``/``retrieve_timesteps`` on a scheduler owned by the
request, so the schedule is the pipeline's, bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps


def flow_match_schedule(scheduler, steps: int, image_seq_len: int, device) -> torch.Tensor:
    """Set ``scheduler`` (this request's own) to ``steps`` with resolution-dependent shift ``mu``;
    returns its timesteps."""
    cfg = scheduler.config
    sigmas = None if getattr(cfg, "use_flow_sigmas", False) else np.linspace(1.0, 1 / steps, steps)
    mu = calculate_shift(
        image_seq_len,
        cfg.get("base_image_seq_len", 256),
        cfg.get("max_image_seq_len", 4096),
        cfg.get("base_shift", 0.5),
        cfg.get("max_shift", 1.15),
    )
    timesteps, _ = retrieve_timesteps(scheduler, steps, device, sigmas=sigmas, mu=mu)
    scheduler.set_begin_index(0)
    return timesteps
