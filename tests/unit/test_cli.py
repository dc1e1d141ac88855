"""The command line: user errors are one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from triptych.cli import build_parser, main


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
