"""``python -m training --out DIR --seed 0 [--resume]``: train every stage, then assemble.

Two processes (one thread each) at a time: first the VAE's joint phases beside the captioner (they do
not depend on each other); then the transformer, which needs the captioner and the VAE's final
encoder, beside the VAE's decoder-only phases (they do not move the latent space). Each stage
checkpoints every few hundred steps and ``--resume`` continues from the last checkpoint (finished
stages and phases are skipped).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import time
from pathlib import Path

from training.stages import run_stage as _stage

logger = logging.getLogger("training")


def _schedule(text: str) -> tuple[int, int | None]:
    """'18000:6800' -> (18000, 6800); '11000' -> (11000, None)."""
    length, _, stop = str(text).partition(":")
    return int(length), int(stop) if stop else None


#: The transformer's phases (``train_dit.PHASES``): (cosine schedule length, step to stop at or None).
DIT_STEPS = [(18000, 6800), (9000, 3000), (10000, 2800), (11000, None), (20000, None), (20000, None), (16000, None)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training", description=__doc__)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--vae-steps", type=int, nargs=3, default=[1200, 1200, 5000], metavar=("P1", "P2", "P3"))
    p.add_argument(
        "--vlm-steps", type=int, nargs=5, default=[1200, 1000, 800, 700, 400], metavar=("P1", "P2", "P3", "P4", "P5")
    )
    p.add_argument(
        "--dit-steps",
        type=_schedule,
        nargs="+",
        default=DIT_STEPS,
        metavar="LEN[:STOP]",
        help="per transformer phase (train_dit.PHASES, one value each): its cosine schedule's length, "
        "and ':N' to stop at step N of it",
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads per process (1: deterministic, fastest on a shared box)"
    )
    p.add_argument("--sequential", action="store_true", help="one stage at a time instead of two processes")
    p.add_argument("--evaluate", action="store_true", help="run training.evaluate on the result")
    args = p.parse_args(argv)
    from training.train_dit import PHASES as DIT_PHASES

    if len(args.dit_steps) != len(DIT_PHASES):
        p.error(f"--dit-steps: {len(args.dit_steps)} values given, the transformer has {len(DIT_PHASES)} phases")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    t0 = time.time()
    from training.train_vae import JOINT_PHASES

    joint = len(JOINT_PHASES)
    waves = [
        [("vae-joint", args.vae_steps[:joint]), ("vlm", args.vlm_steps)],
        [("dit", args.dit_steps), ("vae-decoder", args.vae_steps[joint:])],
    ]
    for wave in waves:
        if args.sequential:
            for name, steps in wave:
                times[name] = _stage(name, str(args.out), args.seed, steps, args.resume, args.threads)
            continue
        ctx = mp.get_context("spawn")
        with ctx.Pool(2) as pool:
            jobs = {
                n: pool.apply_async(_stage, (n, str(args.out), args.seed, s, args.resume, args.threads))
                for n, s in wave
            }
            times.update({n: j.get() for n, j in jobs.items()})
    from training.assemble import assemble
    from training.common import tree_sha256

    model, edit = assemble(args.out)
    times["total"] = time.time() - t0
    summary = {
        "seed": args.seed,
        "steps": {"vae": args.vae_steps, "vlm": args.vlm_steps, "dit": args.dit_steps},
        "wall_seconds_this_invocation": times,
        "sha256": tree_sha256(model),
    }
    (args.out / "training.json").write_text(json.dumps(summary, indent=2))
    logger.info("trained: %s and %s; %s", model, edit, json.dumps(times))
    if args.evaluate:
        from training.evaluate import main as evaluate

        evaluate(["--model", str(model), "--edit-model", str(edit), "--out", str(args.out / "eval")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
