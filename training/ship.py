"""Copy a trained, evaluated run into the package (``triptych/assets/default[_edit]``) with its model card.

``python -m training.ship --run DIR [--eval DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from training.common import tree_sha256, update_json
from triptych.families.models import PACKAGED_DEFAULT

PACKAGED_EDIT = PACKAGED_DEFAULT.parent / "default_edit"


def _size(root: Path) -> int:
    """Bytes on disk, not following the edit directory's links to ``default/`` (os.walk does not)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


#: What only the shipped default gets (not a run's own model): the shape-world prompt normaliser
#: (``shapeworld.prompts``) and image-first chat parts (``ChatModel.image_first``).
SHIPPED_SETTINGS = {"prompt_normaliser": "shapes", "chat_parts": "image-first"}


def _same_tree(a: Path, b: Path) -> bool:
    files = lambda root: sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())  # noqa: E731
    return files(a) == files(b) and all((a / f).read_bytes() == (b / f).read_bytes() for f in files(a))


def ship(run: Path, eval_dir: Path, notes: str = "") -> None:
    """The edit directory links (relative symlinks) every component it shares byte for byte with
    ``default/`` (VAE, text encoder, tokenizer, transformer, scheduler): the weights ship once."""
    for dst in (PACKAGED_DEFAULT, PACKAGED_EDIT):
        if dst.exists():
            shutil.rmtree(dst)
    shutil.copytree(run / "model", PACKAGED_DEFAULT)
    PACKAGED_EDIT.mkdir()
    for entry in sorted((run / "model_edit").iterdir()):
        shared = PACKAGED_DEFAULT / entry.name
        if entry.is_dir() and shared.is_dir() and _same_tree(entry, shared):
            (PACKAGED_EDIT / entry.name).symlink_to(
                Path("..") / PACKAGED_DEFAULT.name / entry.name, target_is_directory=True
            )
        elif entry.is_dir():
            shutil.copytree(entry, PACKAGED_EDIT / entry.name)
        else:
            shutil.copy(entry, PACKAGED_EDIT / entry.name)
    for shipped in (PACKAGED_DEFAULT, PACKAGED_EDIT):
        update_json(shipped / "triptych.json", SHIPPED_SETTINGS)
    for name in ("gallery.png", "gallery_edit.png"):
        if (eval_dir / name).is_file():
            shutil.copy(eval_dir / name, PACKAGED_DEFAULT / name)
    results = json.loads((eval_dir / "results.json").read_text())
    training = json.loads((run / "training.json").read_text()) if (run / "training.json").is_file() else {}
    (PACKAGED_DEFAULT / "MODEL_CARD.md").write_text(card(results, training, notes))


def card(results: dict, training: dict, notes: str) -> str:
    from training.evaluate import table

    hashes = tree_sha256(PACKAGED_DEFAULT)
    sizes = {p.name: _size(p) for p in (PACKAGED_DEFAULT, PACKAGED_EDIT)}
    defaults = json.loads((PACKAGED_DEFAULT / "triptych.json").read_text())
    examples = "\n".join(f"| {a} | {b} |" for a, b in results.get("caption_examples", []))
    template = (Path(__file__).parent / "MODEL_CARD.template.md").read_text()
    vae = json.loads((PACKAGED_DEFAULT / "vae" / "config.json").read_text())
    scale = 2 ** len(vae["temperal_downsample"])
    dit = json.loads((PACKAGED_DEFAULT / "transformer" / "config.json").read_text())
    return template.format(
        dit_arch=f"{dit['num_layers']} layers, {dit['num_attention_heads']} heads x {dit['attention_head_dim']}, "
        f"joint_attention_dim {dit['joint_attention_dim']}, RoPE axes {tuple(dit['axes_dims_rope'])}",
        dit_phases=training.get("dit_phases_note", ""),
        provenance=training.get("provenance", ""),
        vae_arch=f"base_dim {vae['base_dim']}, dim_mult {tuple(vae['dim_mult'])}, z_dim {vae['z_dim']}, **{scale}x** "
        "spatial compression",
        latent=f"{64 // scale}x{64 // scale}x{vae['z_dim']}",
        table=table(results),
        hashes="\n".join(f"    {h}  {p}" for p, h in hashes.items()),
        size_default=sizes["default"] / 1e6,
        size_edit=sizes["default_edit"] / 1e6,
        defaults=json.dumps(defaults),
        training=json.dumps(training, indent=2),
        caption_examples=examples,
        t2i_seconds=results.get("t2i_seconds", float("nan")),
        edit_seconds=results.get("edit_seconds", float("nan")),
        notes=notes,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m training.ship")
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--eval", type=Path)
    p.add_argument("--notes", default="")
    args = p.parse_args(argv)
    ship(args.run, args.eval or args.run / "eval", args.notes)


if __name__ == "__main__":
    main()
