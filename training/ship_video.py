"""Copy a trained, evaluated video run into the package (``triptych/assets/video``) with its model card.

``python -m training.ship_video --run runs/video [--eval runs/video/eval]``

The card is ``MODEL_CARD_VIDEO.template.md`` filled with the evaluation table (``results.json``), the
run record (``RUN/training.json``), the defaults, sizes and weight hashes of the shipped directory.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from training.common import tree_sha256, update_json
from triptych.families.models import PACKAGED_VIDEO


def ship(run: Path, eval_dir: Path, notes: str = "") -> Path:
    if PACKAGED_VIDEO.exists():
        shutil.rmtree(PACKAGED_VIDEO)
    shutil.copytree(run / "model", PACKAGED_VIDEO)
    # Only the shipped model normalises prompts (``shapeworld.prompts``), not a run's own.
    update_json(PACKAGED_VIDEO / "triptych.json", {"prompt_normaliser": "shapes-video"})
    shutil.copy(eval_dir / "gallery.png", PACKAGED_VIDEO / "gallery.png")
    results = json.loads((eval_dir / "results.json").read_text())
    training = json.loads((run / "training.json").read_text()) if (run / "training.json").is_file() else {}
    (PACKAGED_VIDEO / "MODEL_CARD.md").write_text(card(results, training, notes))
    return PACKAGED_VIDEO


def card(results: dict, training: dict, notes: str = "") -> str:
    from training.evaluate_video import table

    size = sum(p.stat().st_size for p in PACKAGED_VIDEO.rglob("*") if p.is_file())
    sep = results.get("separation", {})
    sep_random = results.get("separation_random", {})
    separation = "\n".join(
        f"| {k} | {sep[k]:.2f} | {sep_random.get(k, float('nan')):.2f} |"
        for k in ("shape", "color", "background", "direction")
    )
    template = (Path(__file__).parent / "MODEL_CARD_VIDEO.template.md").read_text()
    return template.format(
        table=table(results),
        notes=notes,
        separation=separation,
        seconds=results.get("seconds", float("nan")),
        n=results["n"],
        size=size / 1e6,
        defaults=json.dumps(json.loads((PACKAGED_VIDEO / "triptych.json").read_text())),
        training=json.dumps(training, indent=2),
        hashes="\n".join(f"    {h}  {p}" for p, h in tree_sha256(PACKAGED_VIDEO).items()),
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m training.ship_video")
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--eval", type=Path)
    p.add_argument("--notes", default="", help="the card's status paragraph")
    args = p.parse_args(argv)
    ship(args.run, args.eval or args.run / "eval", args.notes)


if __name__ == "__main__":
    main()
