"""Every example prompt in README.md and docs/*.md draws what it says, on the shipped default models.

Extraction (explicit): every ``--prompt "..."`` and ``"prompt": "..."`` in README.md, then in each
docs page in name order. A prompt on a
line that names the video model (``triptych/assets/video``) or an ``.mp4`` output is a video example;
on a ``triptych chat`` line, a question for the captioner (asked about the README's first image);
every other one an image example for the default image model. ``"..."`` is a placeholder, not an
example. Each image and video example is generated as the CLI does by default (seed 0) and read
back by the world scorer: every attribute the prompt names (shape, colour, background, and position,
size or direction when given) must be right; a prompt that names no shape, colour or background
fails, since the model cannot draw it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from triptych.families.models import PACKAGED_DEFAULT, PACKAGED_VIDEO

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PAGES = (README, *sorted((REPO / "docs").glob("*.md")))
PROMPT = re.compile(r'(?:--prompt|"prompt":)\s*"([^"]*)"')
PLACEHOLDER = "..."

pytestmark = pytest.mark.skipif(
    not (PACKAGED_DEFAULT / "model_index.json").is_file() or not (PACKAGED_VIDEO / "model_index.json").is_file(),
    reason="no trained default models shipped",
)


def readme_prompts(text: str) -> dict[str, list[str]]:
    """{"image": [...], "video": [...], "chat": [...]}, in README order, placeholders left out."""
    found: dict[str, list[str]] = {"image": [], "video": [], "chat": []}
    for line in text.splitlines():
        for prompt in PROMPT.findall(line):
            if prompt == PLACEHOLDER:
                continue
            if "triptych chat" in line:
                kind = "chat"
            elif "triptych/assets/video" in line or ".mp4" in line:
                kind = "video"
            else:
                kind = "image"
            found[kind].append(prompt)
    return found


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def prompts():
    return readme_prompts("\n".join(page.read_text() for page in PAGES))


def test_extraction_finds_the_readme_examples(prompts):
    assert prompts["image"][0] == "a red circle on a blue background"  # the README's first command
    assert prompts["video"] and prompts["chat"]
    sample = '--prompt "a" x\n"prompt": "b"\ntriptych chat --prompt "c"\n--model triptych/assets/video --prompt "d"\n--prompt "..."'
    assert readme_prompts(sample) == {"image": ["a", "b"], "video": ["d"], "chat": ["c"]}


def _stated(prompt: str, fields: tuple[str, ...]) -> dict[str, str]:
    from shapeworld import parse_caption

    parsed = parse_caption(prompt)
    stated = {k: getattr(parsed, k) for k in fields if getattr(parsed, k) is not None}
    assert {"shape", "color", "background"} <= stated.keys(), f"{prompt!r} does not name a shape, colour and background"
    return stated


def test_image_examples_draw_what_they_say(prompts):
    from shapeworld import read_scene
    from triptych.engine.runner import run_request
    from triptych.families.base import GenerationParams
    from triptych.families.registry import load_family

    family = load_family(PACKAGED_DEFAULT)
    for prompt in prompts["image"]:
        stated = _stated(prompt, ("shape", "color", "background", "position", "size"))
        frames, _ = run_request(family, GenerationParams(prompt=prompt, seed=0))
        read = read_scene(frames.to_uint8()[0])
        drawn = {k: getattr(read, k) for k in stated}
        assert drawn == stated, (prompt, drawn)


def test_video_examples_draw_what_they_say(prompts):
    from shapeworld.prompts import normalise_video_prompt
    from shapeworld.video import DIRECTIONS, Clip
    from shapeworld.video_scorer import score_clip
    from triptych.engine.runner import run_request
    from triptych.families.base import GenerationParams
    from triptych.families.registry import load_family

    family = load_family(PACKAGED_VIDEO)
    for prompt in prompts["video"]:
        stated = _stated(normalise_video_prompt(prompt), ("shape", "color", "background", "size"))
        (direction,) = [d for d in DIRECTIONS if d in normalise_video_prompt(prompt)] or [None]
        assert direction is not None, f"{prompt!r} names no direction"
        clip = Clip(stated["shape"], stated["color"], stated["background"], direction, stated.get("size", "large"))
        frames, _ = run_request(family, GenerationParams(prompt=prompt, seed=0))
        r = score_clip(frames.to_uint8(), clip)
        assert r["direction"] and min(r["shape"], r["color"], r["background"]) >= 0.8, (prompt, r)


def test_chat_examples_name_the_first_examples_image(prompts):
    """``triptych chat --image a.png``: a.png is the first command's image; the answer names it."""
    from shapeworld import parse_caption
    from triptych.chat import ChatParams, ChatTurn
    from triptych.engine.runner import run_request
    from triptych.families.base import GenerationParams
    from triptych.families.registry import load_family

    family = load_family(PACKAGED_DEFAULT)
    first = prompts["image"][0]
    frames, _ = run_request(family, GenerationParams(prompt=first, seed=0))
    image = frames.to_pil()[0]
    truth = parse_caption(first)
    for question in prompts["chat"]:
        answer = family.chat_model().run(ChatParams(turns=(ChatTurn("user", (0, question)),), images=(image,))).text
        said = parse_caption(answer)
        assert (said.shape, said.color) == (truth.shape, truth.color), (question, answer)
