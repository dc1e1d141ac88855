"""Write the trained components as the two diffusers directories the Qwen-Image family adapter loads."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

from training.common import CONDITION_AREA

#: ``world``: the model draws the project's shape world, so ``triptych quality`` and ``calibrate``
#: use (and score) shape-world prompts for it.
#: ``trained_sizes``: the only size the model was trained at (serve and generate warn at any other).
DEFAULTS = {"height": 64, "width": 64, "steps": 20, "guidance": 4.0, "world": "shapes", "trained_sizes": ["64x64"]}
#: The edit model also records the condition image's area it was trained with (the family reads it).
EDIT_DEFAULTS = {"condition_area": CONDITION_AREA}
#: The text-to-image directory of a run that trained edits too (the same transformer, and the
#: processor edits need): one model that generates and edits (``families.qwenimage.generate_edit``).
GENERATE_EDIT_DEFAULTS = {"edits": True, **EDIT_DEFAULTS}


def write_model(parts: dict, out: Path, edit: bool, defaults: dict | None = None) -> Path:
    from diffusers import QwenImageEditPipeline, QwenImagePipeline

    from training.train_dit import scheduler

    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    common = {k: parts[k] for k in ("vae", "text_encoder", "tokenizer", "transformer")}
    if edit:
        QwenImageEditPipeline(scheduler=scheduler(), processor=parts["processor"], **common).save_pretrained(out)
    else:
        QwenImagePipeline(scheduler=scheduler(), **common).save_pretrained(out)
        if "processor" in parts:  # not a QwenImagePipeline component: the family loads it for chat
            # a copy: saving a processor marks its tokenizer, which the edit directory saves next
            copy.deepcopy(parts["processor"]).save_pretrained(out / "processor")
    extra = EDIT_DEFAULTS if edit else GENERATE_EDIT_DEFAULTS if "processor" in parts else {}
    settings = dict(defaults or DEFAULTS, **extra)
    (out / "triptych.json").write_text(json.dumps(settings, indent=2) + "\n")
    return out


def assemble(run: Path, defaults: dict | None = None) -> tuple[Path, Path]:
    from diffusers import QwenImageTransformer2DModel

    from training.train_dit import load_frozen

    parts = load_frozen(run)  # the finished VAE
    parts["transformer"] = QwenImageTransformer2DModel.from_pretrained(run / "transformer")
    return write_model(parts, run / "model", False, defaults), write_model(parts, run / "model_edit", True, defaults)


def random_model(out: Path, seed: int, edit: bool, defaults: dict | None = None) -> Path:
    """The same architecture (and tokenizer) with untrained, seeded weights: the chance baseline."""
    from training import build

    return write_model(build.components(seed, edit=edit), out, edit, defaults)
