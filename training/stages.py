"""One training stage in its own process (importable, so ``multiprocessing`` spawn can pickle it)."""

from __future__ import annotations

import logging
import time
from pathlib import Path


def run_stage(name: str, out: str, seed: int, steps, resume: bool, threads: int) -> float:
    """``name``: "vae-joint" (the VAE phases that train the encoder), "vae-decoder" (the decoder-only
    phases after them), "vlm" or "dit"; ``steps``: one count per phase (for "dit": a (schedule
    length, stop step or None) pair per phase)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    from training.common import setup

    setup(seed, threads)
    start = time.time()
    if name.startswith("vae"):
        from training.train_vae import JOINT_PHASES, PHASES, train_vae

        phases = JOINT_PHASES if name == "vae-joint" else [k for k in PHASES if k not in JOINT_PHASES]
        for phase, n in zip(phases, steps, strict=True):
            train_vae(Path(out), seed, n, phase=phase, resume=resume)
    elif name == "vlm":
        from training.train_vlm import train_vlm

        for phase, n in enumerate(steps, 1):
            train_vlm(Path(out), seed, n, phase=phase, resume=resume)
    else:
        from training.train_dit import train_dit

        for phase, (schedule, stop) in enumerate(steps, 1):
            train_dit(Path(out), seed, schedule, resume=resume, phase=phase, stop=stop)
    return time.time() - start
