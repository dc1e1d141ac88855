"""Helpers shared by the per-family TeaCache tests (Qwen-Image, Wan)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from PIL import Image

from triptych.accel.teacache import TeaCache
from triptych.accel.teacache_profile import ProfileIndex
from triptych.calibration.metrics import psnr


def condition_image(seed=7):
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(40, 48, 3) * 255).astype("uint8"))


def new_cache(family):
    return TeaCache(family.teacache_plan(), ProfileIndex(family.model_dir, family.name))


_ENCODED: dict = {}


def encode(family, p):
    """Encodings are read-only inputs: share them between the runs of a session."""
    key = (family.model_dir, p.prompt, p.negative_prompt, family.uses_cfg(p), p.image and p.image.tobytes())
    if key not in _ENCODED:
        _ENCODED[key] = family.encode(p)
    return _ENCODED[key]


def run(family, plist, tc=None, fuse_cfg=False, stop_after=None):
    """Denoise requests ``r0..`` in one batch; returns states and per-(request, branch) decisions."""
    states = [family.prepare(f"r{i}", p, encode(family, p)) for i, p in enumerate(plist)]
    decisions = defaultdict(list)

    def forward(rows):
        out = tc.forward(rows, family.forward)
        for d in tc.last_decisions:
            decisions[(d.request_id, d.branch)].append(d.compute)
        return out

    steps = 0
    while not all(s.done for s in states) and steps != stop_after:
        family.denoise_step(states, fuse_cfg=fuse_cfg, forward=forward if tc is not None else None)
        steps += 1
    if tc is not None and stop_after is None:
        for s in states:
            tc.release(s.request_id)
    return states, decisions


def decoded_psnr(family, a, b):
    return psnr(family.decode(a.latents, a.params).array, family.decode(b.latents, b.params).array)
