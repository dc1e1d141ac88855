"""The shipped default model (triptych/assets/default[_edit]), read back from pixels with the world scorer.

Held-out scenes only (combinations never seen in training), fixed seeds (evaluate's), one thread.
What is asserted is what the shipped weights do (MODEL_CARD.md has the 50-prompt figures): text to
image gets shape colour and background right on every prompt and the shape kind on most; edits
change what they are asked to; the Qwen2.5-VL captioner, asked through its chat template, names
shape and colour. Bounds leave a one-image margin for float differences between CPUs.
"""

from __future__ import annotations

import pytest

from triptych.families.models import PACKAGED_DEFAULT, default_model_dir

pytestmark = pytest.mark.skipif(
    not (PACKAGED_DEFAULT / "model_index.json").is_file(), reason="no trained default model shipped"
)


@pytest.fixture(scope="module")
def family():
    import torch

    from triptych.families.registry import load_family

    torch.set_num_threads(1)
    return load_family(PACKAGED_DEFAULT)


def test_default_is_the_packaged_qwen_image_model():
    from triptych.families.registry import architecture

    assert default_model_dir() == PACKAGED_DEFAULT
    assert architecture(PACKAGED_DEFAULT) == "QwenImagePipeline"
    assert (PACKAGED_DEFAULT / "MODEL_CARD.md").is_file()


HELDOUT_T2I = 10  # the first 10 of evaluate's 50 held-out prompts
T2I_ALL_RIGHT_AT_LEAST = 9  # measured: 10 of 10 (shape, colour and background)


def test_heldout_prompts_draw_colour_background_and_mostly_the_shape(family):
    from shapeworld import caption, sample_scenes, score
    from triptych.engine.runner import run_request
    from triptych.families.base import GenerationParams

    rows = []
    for index, scene in enumerate(sample_scenes(50, "eval", "heldout")[:HELDOUT_T2I]):
        assert scene.split == "heldout"
        frames, _ = run_request(family, GenerationParams(prompt=caption(scene, "short"), seed=index))
        assert frames.array.shape == (1, 64, 64, 3)
        rows.append(score(frames.to_uint8()[0], scene))
    assert sum(r["color"] and r["background"] for r in rows) >= HELDOUT_T2I - 1, rows
    assert sum(r["shape"] and r["color"] and r["background"] for r in rows) >= T2I_ALL_RIGHT_AT_LEAST, rows


HELDOUT_EDITS = 10
EDITED_AT_LEAST = 9  # measured: 10 of 10 held-out pairs have the edited attribute right
EDITED_AND_KEPT_AT_LEAST = 8  # measured: 9 of 10 also keep every other attribute


def test_heldout_edits_change_the_asked_attribute():
    import torch

    from shapeworld import render, sample_edit_pairs, score
    from triptych.engine.runner import run_request
    from triptych.families.base import GenerationParams
    from triptych.families.models import PACKAGED_DEFAULT
    from triptych.families.registry import load_family

    torch.set_num_threads(1)
    edit = load_family(PACKAGED_DEFAULT.parent / "default_edit")
    assert edit.condition_area == 64 * 64
    edited = kept = 0
    for index, pair in enumerate(sample_edit_pairs(50, "eval", "heldout")[:HELDOUT_EDITS]):
        params = GenerationParams(prompt=pair.instruction, image=render(pair.source, 64), seed=index)
        frames, _ = run_request(edit, params)
        r = score(frames.to_uint8()[0], pair.target)
        edited += r[pair.attribute]
        kept += r[pair.attribute] and all(v for k, v in r.items() if k != pair.attribute)
    assert edited >= EDITED_AT_LEAST and kept >= EDITED_AND_KEPT_AT_LEAST, (edited, kept)


CAPTION_SCENES = 50  # MODEL_CARD.md's 50 held-out images
CAPTIONS_RIGHT_AT_LEAST = 40  # the documented target, 80%; measured 41 of 50 (82%, the card's figure)


def test_captioner_names_shape_and_colour_of_heldout_images():
    """Every one of the card's 50 held-out scenes is captioned (none left out); the rate that names
    both shape and colour is held to the documented 80% target."""
    import torch
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from shapeworld import render, sample_scenes, score_caption
    from training import build
    from training.train_vlm import caption_images

    torch.set_num_threads(1)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(PACKAGED_DEFAULT / "text_encoder").eval()
    processor = build.processor(AutoTokenizer.from_pretrained(PACKAGED_DEFAULT / "tokenizer"))
    scenes = sample_scenes(CAPTION_SCENES, "eval-captions", "heldout")
    answers = caption_images(model, processor, [render(s, 64) for s in scenes])
    wrong = [(s, a) for s, a in zip(scenes, answers) if not all(score_caption(a, s)[k] for k in ("shape", "color"))]
    assert CAPTION_SCENES - len(wrong) >= CAPTIONS_RIGHT_AT_LEAST, wrong


# TeaCache 0.1 with the shipped profile (format /3: warmup 6, at most one skip in a row, linear forecast)
# on the first 6 quality prompts: measured 29% of the rows skipped, worst PSNR 49.2 dB (mean 61.1)
# against the plain run, adherence 6 of 6 as plain. The failing side asks for a worst PSNR 1 dB above
# the one this run measured, so it holds whatever profile ships; the passing side is the calibration
# target's 30 dB (the profile's threshold 0.3 met it on 50 images), 19 dB under the measured worst.
QUALITY_MIN_PSNR = 30.0
QUALITY_MAX_ADHERENCE_DROP = 0.2  # one image of the six


def test_quality_report_on_the_default_model_scores_adherence_with_its_shipped_profile():
    """The packaged TeaCache profile (20 steps) and the shape world make ``triptych quality`` work out
    of the box: adherence is read from pixels on both sides, skipped work and fidelity are measured.
    Both gates are set and pass; a PSNR gate above the measured worst image fails the same requests."""
    from triptych.calibration.quality import quality_report

    gates = dict(min_psnr=QUALITY_MIN_PSNR, max_adherence_drop=QUALITY_MAX_ADHERENCE_DROP)
    report = quality_report(PACKAGED_DEFAULT, [0.1], images=6, **gates)
    (row,) = report["settings"]
    assert report["world"] is True and report["steps"] == 20 and report["passed"], row["failures"]
    strict = quality_report(PACKAGED_DEFAULT, [0.1], images=6, min_psnr=row["psnr_min"] + 1.0)
    assert not strict["passed"] and "PSNR" in strict["settings"][0]["failures"][0]
    assert report["plain_adherence"] >= 5 / 6  # measured on the first 6 quality prompts: 6 of 6
    assert 0 < row["skipped_fraction"] < 1 and row["adherence"] is not None
    assert 0 < row["ssim_min"] <= row["ssim_mean"] <= 1
