"""The default model's prompt encode with the execution device looked up once (``Family.execution_device``)
against the same encode reading diffusers' ``Pipeline._execution_device`` once per CFG branch, as
the encode stage did before (commit ee441a6), side by side in one process.

The peer runs ``family.encode`` after the two property reads the old code made (the property walks
every module's offload hooks; its value is what was passed on, so the encode itself is the same).
One torch thread, process CPU time, ``--repeats`` rounds of ``--encodes`` encodes each after a
warm-up round, alternating which runs first; reported: best round per encode, and the ratio.

    python benchmarks/encode_device.py [--repeats 8] [--encodes 20]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from triptych.families.base import GenerationParams, Role  # noqa: E402
from triptych.families.models import default_model_dir  # noqa: E402
from triptych.families.registry import load_family  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--encodes", type=int, default=20)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    family = load_family(default_model_dir(), roles=(Role.ENCODER,))
    params = family.resolve(GenerationParams(prompt="a red circle on a blue background", seed=0))

    def now() -> None:
        family.encode(params)

    def before() -> None:
        for _ in family.encode(params).branches:  # one read per branch, as encode_text made them
            _ = family.pipe._execution_device

    runs = {"looked up once (this tree)": now, "read per branch (before)": before}
    times = {name: [] for name in runs}
    for fn in runs.values():
        fn()
    for r in range(args.repeats):
        for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            t = time.process_time()
            for _ in range(args.encodes):
                runs[name]()
            times[name].append((time.process_time() - t) / args.encodes)
    best = {name: min(v) * 1000 for name, v in times.items()}
    print("| prompt encode (cond + negative), default model | CPU ms per encode (best round) |")
    print("|---|---:|")
    for name, ms in best.items():
        print(f"| {name} | {ms:.2f} |")
    print(f"ratio: {best['read per branch (before)'] / best['looked up once (this tree)']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
