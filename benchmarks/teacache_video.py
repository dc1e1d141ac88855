"""TeaCache on the packaged video model, on held-out clips: skipped share against worst-frame PSNR and
motion kept.

``triptych calibrate`` chooses the shipped profile's setting on train-split clip captions; this
script checks it, and the settings around it, on clips of held-out (shape, colour, background)
combinations (``triptych.calibration.clips.heldout_clips``, seeds from 0: what ``triptych quality``
scores), with the shipped polynomial and the calibration's own sweep (``triptych.calibration.sweep``:
the same requests in the same batches as the plain path, PSNR/SSIM of each clip's worst frame, clip
adherence, and the share of clips keeping the plain clip's direction and shape colour).

Every threshold runs with every variant ``W:C:F``: first W steps computed, at most C skips in a row
(0: no cap), forecast F (0 reuse, 1 linear); the plain path runs once.

    PYTHONPATH=. nice -n 10 python benchmarks/teacache_video.py [--clips 24] [--thresholds 0.3] [--variants 4:1:0 ...]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from triptych.accel.teacache import TeaCache  # noqa: E402
from triptych.accel.teacache_profile import find_profile  # noqa: E402
from triptych.calibration.batch import Cases  # noqa: E402
from triptych.calibration.clips import caption, heldout_clips  # noqa: E402
from triptych.calibration.sweep import sweep, table_markdown  # noqa: E402
from triptych.families.base import GenerationParams, Role  # noqa: E402
from triptych.families.models import PACKAGED_VIDEO  # noqa: E402
from triptych.families.registry import load_family  # noqa: E402

DEFAULT_VARIANTS = ("2:1:0", "4:1:0", "2:2:0", "2:2:1", "4:2:1")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clips", type=int, default=24, help="held-out clips (seeds 0..)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.3])
    ap.add_argument("--variants", nargs="+", metavar="W:C:F", default=list(DEFAULT_VARIANTS))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    family = load_family(PACKAGED_VIDEO, roles=(Role.ENCODER, Role.DENOISER, Role.DECODER))
    shipped = find_profile(PACKAGED_VIDEO, args.steps, family.name)
    if shipped is None:
        raise SystemExit(f"no shipped profile for {family.name} at {args.steps} steps")
    clips = heldout_clips(args.clips)
    cases = Cases(family, [GenerationParams(prompt=caption(c), seed=i, steps=args.steps) for i, c in enumerate(clips)])
    plan = family.teacache_plan()
    variants = [(int(w), int(c) or None, int(f)) for w, c, f in (v.split(":") for v in args.variants)]
    cache_for = lambda p: TeaCache(plan, profiles=lambda n: p)  # noqa: E731
    rows = sweep(cache_for, shipped, cases, args.thresholds, variants, clips, batch_size=args.batch).rows
    print(
        f"packaged video model ({family.name}), {args.steps} steps, {len(clips)} held-out clips (seeds 0-{len(clips) - 1}),"
        f" batch {args.batch}; shipped profile: threshold {shipped.recommended_threshold}, warmup {shipped.warmup},"
        f" cap {shipped.max_skips}, forecast {shipped.forecast}; target {shipped.target}"
    )
    print(table_markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
