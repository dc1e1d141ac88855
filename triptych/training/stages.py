"""One training stage in its own process (importable, so ``multiprocessing`` spawn can pickle it)."""

from __future__ import annotations

import logging
import time
from pathlib import Path


def run_stage(name: str, out: str, seed: int, steps, resume: bool, threads: int) -> float:
    """``name``: "vae-joint" (the VAE phases that train the encoder), "vae-decoder" (the decoder-only
    phases after them), "vlm" or "dit"; ``steps``: one count per phase (for "dit": ((schedule
    length, stop step) of phase 1, phase 2's steps))."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    from triptych.training.common import setup

    setup(seed, threads)
    start = time.time()
    if name.startswith("vae"):
        from triptych.training.train_vae import JOINT_PHASES, PHASES, train_vae

        phases = JOINT_PHASES if name == "vae-joint" else [k for k in PHASES if k not in JOINT_PHASES]
        for phase, n in zip(phases, steps, strict=True):
            train_vae(Path(out), seed, n, phase=phase, resume=resume)
    elif name == "vlm":
        from triptych.training.train_vlm import train_vlm

        for phase, n in enumerate(steps, 1):
            train_vlm(Path(out), seed, n, phase=phase, resume=resume)
    else:
        from triptych.training.train_dit import train_dit

        (phase1, stop), phase2 = steps
        train_dit(Path(out), seed, phase1, resume=resume, phase=1, stop=stop)
        train_dit(Path(out), seed, phase2, resume=resume, phase=2)
    return time.time() - start
