"""ConfigFlags: a frozen config dataclass as argparse flags, and back."""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from triptych.core.config_flags import ConfigFlags, add_flags_later, field_docs


class Mode(enum.Enum):
    FAST = "fast"
    EXACT = "exact"


@dataclass(frozen=True)
class Inner:
    depth: int = 1


@dataclass(frozen=True)
class Demo:
    steps: int = 4
    """How many steps to run. Bounds: >= 1."""
    ratio: float = 0.5
    """A fraction, 0..100%."""
    name: str = "demo"
    fused: bool = True
    """Fuse the branches."""
    out: Path = Path("out")
    ttl_s: float | None = 60.0
    """Lifetime; none keeps it."""
    kind: Literal["a", "b"] = "a"
    mode: Mode = Mode.FAST
    tags: tuple[str, ...] = ("x",)
    inner: Inner = field(default_factory=Inner)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"Demo.steps={self.steps}: must be >= 1")
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ValueError(f"ttl_s={self.ttl_s} must be > 0 when steps={self.steps}")


def parser_for(**kwargs) -> tuple[argparse.ArgumentParser, ConfigFlags]:
    parser = argparse.ArgumentParser(prog="demo")
    return parser, ConfigFlags(parser, Demo, **kwargs)


def test_field_docs_are_the_strings_under_the_fields():
    docs = field_docs(Demo)
    assert docs["steps"] == "How many steps to run. Bounds: >= 1."
    assert docs["fused"] == "Fuse the branches."
    assert "name" not in docs and "inner" not in docs


def test_every_flag_is_in_help_with_its_doc_and_default(capsys):
    parser, flags = parser_for()
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--steps", "--ratio", "--name", "--fused", "--no-fused", "--out", "--ttl-s", "--kind", "--mode"):
        assert flag in text
    assert "How many steps to run. Bounds: >= 1. (default: 4)" in text
    assert "A fraction, 0..100%. (default: 0.5)" in text
    assert "--tags TAGS (default: x)" in text
    assert "--inner" not in text  # a nested config is the caller's
    assert set(flags.flags) == {"steps", "ratio", "name", "fused", "out", "ttl_s", "kind", "mode", "tags"}


def test_no_flags_builds_the_dataclass_default():
    parser, flags = parser_for()
    assert flags.build(parser.parse_args([]), parser) == Demo()


def test_flags_parse_to_typed_values():
    parser, flags = parser_for()
    argv = ["--steps", "7", "--no-fused", "--out", "o", "--ttl-s", "none", "--kind", "b", "--mode", "exact"]
    config = flags.build(parser.parse_args([*argv, "--tags", "p", "--tags", "q"]), parser, inner=Inner(3))
    assert config == Demo(
        steps=7, fused=False, out=Path("o"), ttl_s=None, kind="b", mode=Mode.EXACT, tags=("p", "q"), inner=Inner(3)
    )


def test_argv_reproduces_a_config():
    parser, flags = parser_for()
    config = Demo(steps=9, ratio=0.25, fused=False, ttl_s=None, mode=Mode.EXACT, tags=("a", "b"))
    argv = flags.argv(config)
    assert flags.build(parser.parse_args(argv), parser) == config
    assert flags.argv(Demo()) == []


def test_a_value_the_dataclass_refuses_exits_2_naming_the_flag(capsys):
    parser, flags = parser_for()
    with pytest.raises(SystemExit) as exit_:
        flags.build(parser.parse_args(["--steps", "0"]), parser)
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "demo: error: argument --steps: Demo.steps=0: must be >= 1"


def test_the_first_field_the_message_names_is_the_flag(capsys):
    parser, flags = parser_for(prefix="demo-")
    with pytest.raises(SystemExit):
        flags.build(parser.parse_args(["--demo-ttl-s", "-1"]), parser)
    assert "error: argument --demo-ttl-s: ttl_s=-1.0 must be > 0 when steps=4" in capsys.readouterr().err


def test_a_badly_typed_value_exits_2_naming_the_flag(capsys):
    parser, _ = parser_for()
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--ttl-s", "soon"])
    assert exit_.value.code == 2
    assert "argument --ttl-s: invalid float value: 'soon'" in capsys.readouterr().err


def test_only_rename_choices_and_explicit():
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=4)
    flags = ConfigFlags(
        parser,
        Demo,
        only=("ratio", "name", "fused"),
        rename={"fused": "fuse-branches"},
        choices={"name": ("demo", "other")},
        explicit={"steps": "--count"},
    )
    assert flags.flags == {"ratio": "--ratio", "name": "--name", "fused": "--fuse-branches"}
    args = parser.parse_args(["--no-fuse-branches", "--count", "0"])
    assert flags.error_message("Demo.steps=0: must be >= 1") == "argument --count: Demo.steps=0: must be >= 1"
    assert flags.build(args, parser, steps=2) == Demo(steps=2, fused=False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--name", "third"])


def test_unknown_field_names_and_unsupported_types_are_refused():
    with pytest.raises(ValueError, match="no field"):
        parser_for(rename={"stpes": "x"})

    @dataclass(frozen=True)
    class Odd:
        table: dict = field(default_factory=dict)

    with pytest.raises(TypeError, match="table"):
        ConfigFlags(argparse.ArgumentParser(), Odd)


def test_flags_added_later_appear_when_the_parser_is_used(capsys):
    calls = []

    def add(parser):
        calls.append(parser)
        ConfigFlags(parser, Demo)

    top = argparse.ArgumentParser(prog="top")
    sub = top.add_subparsers(dest="command")
    demo = sub.add_parser("demo")
    add_flags_later(demo, add)
    sub.add_parser("other")
    assert top.parse_args(["other"]).command == "other" and calls == []
    top.format_help()
    assert calls == []
    assert top.parse_args(["demo", "--steps", "3"]).steps == 3 and calls == [demo]
    with pytest.raises(SystemExit):
        top.parse_args(["demo", "--help"])
    assert "How many steps to run" in capsys.readouterr().out and calls == [demo]
