"""The command line: user errors are one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from triptych.cli import build_parser, main
from triptych.core.errors import InvalidParam


@pytest.mark.parametrize(
    "args, field",
    [
        (["--height", "60"], "height"),
        (["--steps", "0"], "steps"),
        (["--frames", "5"], "frames"),
        (["--negative-prompt", "x"], "negative_prompt"),
        (["--mm-cache-mb", "-1"], "mm_cache_mb"),
    ],
)
def test_bad_parameters_exit_2_naming_the_field(tiny_model_dir, tmp_path, capsys, args, field):
    rc = main(["generate", "--model", tiny_model_dir("flux"), "--prompt", "x", "--out", str(tmp_path / "a.png"), *args])
    err = capsys.readouterr().err
    assert rc == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: invalid ") and field in last and "Traceback" not in err
    assert not (tmp_path / "a.png").exists()


def test_unknown_model_directory_lists_supported_families(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x", "--out", str(tmp_path / "a.png")]) == 2
    err = capsys.readouterr().err
    assert "model_index.json" in err and "FluxPipeline" in err and "WanPipeline" in err


def test_image_for_text_only_family_and_missing_file(tiny_model_dir, tmp_path, capsys):
    out = str(tmp_path / "a.png")
    assert (
        main(
            [
                "generate",
                "--model",
                tiny_model_dir("flux"),
                "--prompt",
                "x",
                "--image",
                "/nonexistent.png",
                "--out",
                out,
            ]
        )
        == 2
    )
    assert "image" in capsys.readouterr().err


def test_bad_extension_is_refused(tiny_model_dir, tmp_path, capsys):
    assert main(["generate", "--model", tiny_model_dir("flux"), "--prompt", "x", "--out", str(tmp_path / "a.gif")]) == 2
    assert "out" in capsys.readouterr().err


def test_generate_writes_an_image_in_a_subprocess(tiny_model_dir, tmp_path):
    """As a user runs it: the console entry point, a PNG written, timings printed."""
    out = tmp_path / "a.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "triptych.cli",
            "generate",
            "--model",
            tiny_model_dir("flux"),
            "--prompt",
            "a red circle",
            "--height",
            "48",
            "--width",
            "80",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "timings:" in proc.stdout and "denoise" in proc.stdout
    # the bar shows a served job's progress: steps to 90%, then the decode to 100%
    assert "decoding" in proc.stderr and "100/100%" in proc.stderr, proc.stderr
    from PIL import Image

    with Image.open(out) as img:
        assert img.size == (80, 48)


def test_mm_cache_budget_defaults_to_the_environment(monkeypatch):
    argv = ["generate", "--prompt", "x", "--out", "a.png"]
    monkeypatch.delenv("TRIPTYCH_MM_CACHE_MB", raising=False)
    assert build_parser().parse_args(argv).mm_cache_mb == 256.0
    monkeypatch.setenv("TRIPTYCH_MM_CACHE_MB", "0")
    assert build_parser().parse_args(argv).mm_cache_mb == 0.0
    assert build_parser().parse_args([*argv, "--mm-cache-mb", "8"]).mm_cache_mb == 8.0


BAD_BEFORE_TORCH = [
    (["generate", "--prompt", "x", "--image", "README.md", "--out", "a.png"], "image='README.md'"),
    (["generate", "--prompt", "x", "--steps", "0", "--out", "a.png"], "steps=0"),
    (["generate", "--prompt", "x", "--out", "a.gif"], "out='a.gif'"),
    (["generate", "--prompt", "x", "--model", "/nonexistent", "--out", "a.png"], "model='/nonexistent'"),
    (["chat", "--prompt", "x", "--image", "/nonexistent.png"], "image[0]='/nonexistent.png'"),
    (["chat", "--prompt", "x", "--top-p", "0"], "top_p=0.0"),
    (["calibrate", "--steps", "4", "--out", "triptych/assets/default/teacache/x.json"], "out='triptych/assets"),
    (["quality", "--teacache-threshold", "0.1", "--images", "0"], "images=0"),
    (["generate", "--prompt", "x", "--out", "a.png", "--threads", "-1"], "--threads=-1"),
    (["generate", "--prompt", "x", "--height", "4096", "--width", "4096", "--out", "a.png"], "size='4096x4096'"),
    (["generate", "--prompt", "x", "--steps", "101", "--out", "a.png"], "steps=101"),
]


def test_bad_arguments_are_refused_before_torch_is_imported():
    """Each command's checks run before the torch import (30-50 s on a loaded machine): a fresh
    interpreter gets exit code 2 and a line naming the field while ``torch`` is still not imported."""
    script = (
        "import json, sys\n"
        "from triptych.cli import main\n"
        "out = []\n"
        f"for argv in {[a for a, _ in BAD_BEFORE_TORCH]!r}:\n"
        "    out.append([main(argv), 'torch' in sys.modules])\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=_repo())
    assert proc.returncode == 0, proc.stderr
    import json

    assert json.loads(proc.stdout) == [[2, False]] * len(BAD_BEFORE_TORCH), proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == len(BAD_BEFORE_TORCH), proc.stderr
    for line, (_, named) in zip(lines, BAD_BEFORE_TORCH):
        assert line.startswith("error: invalid ") and named in line, line
    assert lines[0] == "error: invalid image='README.md': is not a decodable PNG/JPEG/WebP image " + (
        f"({(_repo() / 'README.md').stat().st_size} bytes)"
    )


def _repo():
    from pathlib import Path

    return Path(__file__).resolve().parents[2]


def test_a_misspelt_flag_shows_the_subcommands_usage(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--prompt", "x", "--out", "a.png", "--promt", "y"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: triptych generate ")
    last = "triptych generate: error: unrecognized arguments: --promt (did you mean --prompt?) y"
    assert err.strip().splitlines()[-1] == last


def test_an_unknown_flag_far_from_every_flag_gets_no_suggestion(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--out", "a.png", "--zzzzzz", "--heigth=64"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith("unrecognized arguments: --zzzzzz --heigth=64 (did you mean --height?)"), last


@pytest.mark.parametrize(
    "command",
    [["generate", "--prompt", "x", "--out", "a.png"], ["chat", "--prompt", "x"], ["calibrate", "--steps", "2"]]
    + [["quality", "--teacache-threshold", "0.1"]],
)
def test_every_in_process_command_sets_torch_threads_by_the_serve_rule(tmp_path, monkeypatch, capsys, command):
    """``--threads N`` is N; 0 (the default) is ``split_threads`` (the idle cores: 8 cores, 2.4 busy ->
    6). Each command sets them before loading, so an empty model directory (refused at load) shows it."""
    import torch

    monkeypatch.setattr("os.cpu_count", lambda: 8)
    monkeypatch.setattr("os.getloadavg", lambda: (2.4, 0.0, 0.0))
    before = torch.get_num_threads()
    try:
        for flags, expected in (([], 6), (["--threads", "3"], 3)):
            torch.set_num_threads(1)
            assert main([*command, "--model", str(tmp_path), *flags]) == 2  # no model_index.json
            assert "cannot load model" in capsys.readouterr().err
            assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(before)


def test_generate_holds_a_request_to_the_servers_limits_unless_lifted():
    """The head's own checks (``AdmissionLimits``): the flags before loading, the resolved request
    (a model default, the model's token count) after; ``--no-limits`` lifts both."""
    from types import SimpleNamespace

    from triptych.cli.limits import LIFT, check_args, check_resolved
    from triptych.families.base import GenerationParams
    from triptych.head.admission import AdmissionLimits

    def flags(**kw):
        return SimpleNamespace(
            **{"steps": None, "frames": None, "height": None, "width": None, "no_limits": False, **kw}
        )

    with pytest.raises(InvalidParam) as refused:
        check_args(flags(frames=162))
    assert refused.value.field == "frames" and "161" in refused.value.rule and LIFT in refused.value.rule
    check_args(flags(frames=162, steps=1000, height=8192, width=8192, no_limits=True))
    check_args(flags(height=4096))  # one side alone: the model's default fills the other, checked after loading

    image = SimpleNamespace(is_video=False, sequence_tokens=lambda p: p.width * p.height // 256)
    params = GenerationParams(prompt="x", height=2048, width=2048, steps=4, frames=1)
    check_resolved(image, params, no_limits=False)  # 16,384 tokens: within the default 32,768
    with pytest.raises(InvalidParam) as tokens:
        check_resolved(image, params, no_limits=False, limits=AdmissionLimits(max_tokens=16_383))
    assert tokens.value.field == "size" and "16384 transformer tokens" in tokens.value.rule, tokens.value
    with pytest.raises(InvalidParam) as steps:
        check_resolved(image, params.replace(steps=101), no_limits=False)
    assert steps.value.field == "steps"
    check_resolved(image, params.replace(steps=101, height=8192), no_limits=True)


def test_generate_warns_of_words_a_shipped_model_does_not_know(tmp_path, capsys):
    import json
    from types import SimpleNamespace

    from triptych.cli.notes import warn_unknown_words
    from triptych.families.base import GenerationParams

    (tmp_path / "triptych.json").write_text(json.dumps({"prompt_normaliser": "shapes"}))
    family = SimpleNamespace(model_dir=tmp_path, is_video=False)
    warn_unknown_words(family, GenerationParams(prompt="draw a blue triangle on a white background"))
    warn_unknown_words(family, GenerationParams(prompt="a blue triangle on a white background"))
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"warning: model {tmp_path.name!r} does not know the word 'draw'")


def test_a_long_generate_says_its_estimate_after_the_first_step():
    from triptych.cli.estimate import StepEstimate, duration

    now = [100.0]
    said: list[str] = []
    slow = StepEstimate(said.append, long_s=30, clock=lambda: now[0])
    slow.started()
    now[0] += 300.0  # the first step (with the encode): 5 minutes
    for step in range(1, 5):
        slow.step(step, 20)
    assert said == ["estimate: about 1.6 h more for the 19 steps left (5.0 min for the first); Ctrl-C stops it"]

    quick = StepEstimate(said.append, long_s=30, clock=lambda: now[0])
    quick.started()
    now[0] += 1.0
    quick.step(1, 20)  # 19 s to go: nothing said
    assert len(said) == 1 and quick.estimate_s == 19.0
    assert [duration(s) for s in (42, 210, 5760)] == ["42 s", "3.5 min", "1.6 h"]


def test_a_misspelt_flag_is_named_when_the_flag_it_meant_is_required(capsys):
    """``--promt x`` leaves the required ``--prompt`` missing, which argparse reports alone."""
    with pytest.raises(SystemExit) as exit_:
        main(["--verbose", "generate", "--promt", "x", "--out", "a.png"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2
    assert last == (
        "triptych generate: error: unrecognized arguments: --promt (did you mean --prompt?); "
        "the following arguments are required: --prompt"
    ), last
