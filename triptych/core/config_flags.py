"""Command-line flags built from a frozen config dataclass, and the dataclass built back from them.

``ConfigFlags(parser, EngineConfig)`` adds one flag per field: ``--field-name`` (``prefix`` and
``rename`` change the name), its type read from the annotation, its default the dataclass's, its
help the attribute docstring under the field. ``flags.build(args, parser)`` constructs the
dataclass from the parsed values; a ``ValueError`` from its ``__post_init__`` becomes one argparse
error line naming the flag (exit code 2), like a badly typed value. ``flags.argv(config)`` turns a
config back into the flags that reproduce it (to pass on to a child process).
``add_flags_later(parser, add)`` defers adding a subcommand's flags until it is used.

Supported annotations: ``int``, ``float``, ``str``, ``bool`` (``--x`` / ``--no-x``), ``Path``,
``Literal[...]`` and ``Enum`` (choices), ``X | None`` (the value ``none`` gives None; for
``bool | None``, giving neither ``--x`` nor ``--no-x``) and
``tuple[X, ...]`` (the flag repeated); ``parse`` gives a field its own value parser. A field without
a default is a required flag. A field whose type is a dataclass (a nested config) gets no flag; the
caller handles it, as it does any field it names in ``explicit``. Another annotation raises
``TypeError`` when the flags are built, so a new field never goes unexposed silently.

``argv_of(cls, config, **spec)`` is ``argv`` without a parser of one's own: what a process that
spawns another (the supervisor starting ``triptych worker``) uses to pass a config on.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import inspect
import re
import textwrap
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

NONE = "none"  # the command-line spelling of None for an optional field

_SCALARS: dict[type, Callable[[str], Any]] = {int: int, float: float, str: str, Path: Path}
_METAVARS: dict[Callable[[str], Any], str] = {int: "INT", float: "FLOAT", str: "TEXT", Path: "PATH"}


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name → the docstring written under it in the class body (base classes included)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # no source (built in a REPL, frozen app): no help text
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse_optional(text: str) -> Any:
        return None if text.strip().lower() == NONE else parse(text)

    parse_optional.__name__ = getattr(parse, "__name__", "value")  # argparse names it in "invalid X value"
    return parse_optional


def _one_of(parse: Callable[[str], Any], allowed: Sequence[Any]) -> Callable[[str], Any]:
    def parse_choice(text: str) -> Any:
        value = parse(text)
        if value not in allowed:
            raise ValueError(text)
        return value

    parse_choice.__name__ = "choice"
    return parse_choice


def _flag_kwargs(name: str, annotation: Any) -> dict[str, Any] | None:
    """argparse keyword arguments for a field of this annotation; None for a nested dataclass."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType) and set(args) == {bool, type(None)}:
        return {"action": argparse.BooleanOptionalAction}  # neither --x nor --no-x: None (auto)
    if origin in (typing.Union, types.UnionType) and type(None) in args and len(args) == 2:
        inner = _flag_kwargs(name, next(a for a in args if a is not type(None)))
        if inner is None or "type" not in inner or inner.get("action"):
            raise TypeError(f"config field {name}: optional {annotation!r} is not supported as a flag")
        shown = inner.get("metavar") or _METAVARS.get(inner["type"], "VALUE")
        if "choices" in inner:  # argparse would refuse "none": the parse function checks them instead
            allowed = inner.pop("choices")
            shown = "{" + ",".join(_text(c) for c in allowed) + "}"
            inner["type"] = _one_of(inner["type"], allowed)
        return {**inner, "type": _optional(inner["type"]), "metavar": f"{shown}|{NONE}"}
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        inner = _flag_kwargs(name, args[0])
        if inner is None or "type" not in inner or inner.get("action"):
            raise TypeError(f"config field {name}: {annotation!r} is not supported as a flag")
        return {**inner, "action": "append"}
    if origin is typing.Literal:
        return {"type": type(args[0]), "choices": list(args)}
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return {
            "type": annotation,
            "choices": list(annotation),
            "metavar": "{" + ",".join(str(m.value) for m in annotation) + "}",
        }
    if annotation in _SCALARS:
        return {"type": _SCALARS[annotation]}
    if dataclasses.is_dataclass(annotation):
        return None
    raise TypeError(f"config field {name}: type {annotation!r} has no command-line form")


def _help(doc: str, default: str = "%(default)s") -> str:
    text = " ".join(doc.replace("``", "").split()).replace("%", "%%")
    return f"{text} (default: {default})" if text else f"(default: {default})"


class ConfigFlags:
    """The flags of one config dataclass on one parser (see the module docstring).

    ``only`` limits the flags to those fields (the others keep their dataclass default, or come
    from ``build``'s keyword arguments); ``explicit`` maps fields the caller adds flags for itself
    to those flags, so an error about them still names the flag (None: a field with no flag, that
    the caller fills in); ``rename`` gives a field another
    flag name (without ``--``; ``prefix`` is not added); ``choices`` restricts a field's values;
    ``parse`` maps a field to the function that reads its text (its ``__name__`` names it in errors).
    """

    def __init__(
        self,
        parser: argparse.ArgumentParser | argparse._ArgumentGroup,
        cls: type,
        *,
        prefix: str = "",
        only: Sequence[str] | None = None,
        explicit: Mapping[str, str | None] | None = None,
        rename: Mapping[str, str] | None = None,
        choices: Mapping[str, Sequence[Any]] | None = None,
        parse: Mapping[str, Callable[[str], Any]] | None = None,
    ):
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls!r} is not a dataclass")
        self.cls = cls
        self.explicit = dict(explicit or {})
        rename, choices, parse = dict(rename or {}), dict(choices or {}), dict(parse or {})
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = (set(only or ()) | set(self.explicit) | set(rename) | set(choices) | set(parse)) - names
        if unknown:
            raise ValueError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        self.flags: dict[str, str] = {}  # field name -> "--flag"
        self.dests: dict[str, str] = {}  # field name -> attribute on the parsed namespace
        self.defaults: dict[str, Any] = {}
        self._repeated: set[str] = set()  # tuple fields: the flag is given once per item
        self._required: set[str] = set()  # fields without a default: always in ``argv``
        for f in dataclasses.fields(cls):
            if not f.init or f.name in self.explicit or (only is not None and f.name not in only):
                continue
            kwargs = _flag_kwargs(f.name, hints[f.name])
            if kwargs is None:  # a nested config: the caller builds it
                continue
            default = self._default(f)
            flag = "--" + rename.get(f.name, prefix + f.name).replace("_", "-")
            dest = flag[2:].replace("-", "_")
            if f.name in choices:
                kwargs["choices"] = list(choices[f.name])
            if f.name in parse:
                kwargs["type"] = parse[f.name]
            if default is dataclasses.MISSING:
                if kwargs.get("action"):
                    raise TypeError(f"config field {cls.__name__}.{f.name}: a required flag takes a value")
                doc = " ".join(docs.get(f.name, "").replace("``", "").split()).replace("%", "%%")
                parser.add_argument(flag, dest=dest, required=True, help=f"{doc} (required)", **kwargs)
                self._required.add(f.name)
            elif kwargs.get("action") == "append":
                # argparse appends to a non-empty default; None means "not given" -> the default
                shown = " ".join(map(_text, default)).replace("%", "%%") or "none"
                parser.add_argument(flag, dest=dest, default=None, help=_help(docs.get(f.name, ""), shown), **kwargs)
                self._repeated.add(f.name)
            else:
                parser.add_argument(flag, dest=dest, default=default, help=_help(docs.get(f.name, "")), **kwargs)
            self.flags[f.name], self.dests[f.name], self.defaults[f.name] = flag, dest, default

    @staticmethod
    def _default(f: dataclasses.Field) -> Any:
        if f.default is not dataclasses.MISSING:
            return f.default
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        return dataclasses.MISSING

    def values(self, args: argparse.Namespace) -> dict[str, Any]:
        """The parsed value of every flag of this config, by field name."""
        out = {}
        for name, dest in self.dests.items():
            value = getattr(args, dest)
            if name in self._repeated:
                value = self.defaults[name] if value is None else tuple(value)
            out[name] = value
        return out

    def build(self, args: argparse.Namespace, parser: argparse.ArgumentParser, **fields: Any) -> Any:
        """The config from the parsed flags plus ``fields`` (the explicit and nested ones); a
        ``ValueError`` it raises exits through ``parser.error`` naming the flag (exit code 2)."""
        try:
            return self.cls(**self.values(args), **fields)
        except ValueError as e:
            parser.error(self.error_message(str(e)))

    def error_message(self, message: str) -> str:
        """``argument --flag: <message>`` on one line, for the first field the message names."""
        message = " ".join(message.split())
        named = {**self.flags, **{name: flag for name, flag in self.explicit.items() if flag}}
        found = [(m.start(), name) for name in named if (m := re.search(rf"(?<![\w-]){re.escape(name)}\b", message))]
        if not found:
            return f"invalid {self.cls.__name__}: {message}"
        return f"argument {named[min(found)[1]]}: {message}"

    def argv(self, config: Any) -> list[str]:
        """The flags that reproduce ``config``'s values where they differ from the defaults."""
        out: list[str] = []
        for name, flag in self.flags.items():
            value = getattr(config, name)
            if name not in self._required and value == self.defaults[name]:
                continue
            if isinstance(value, bool):
                out.append(flag if value else "--no-" + flag[2:])
            elif isinstance(value, tuple):
                for item in value:
                    out += [flag, _text(item)]
            else:
                out += [flag, _text(value)]
        return out


def argv_of(cls: type, config: Any, **spec: Any) -> list[str]:
    """``ConfigFlags(parser, cls, **spec).argv(config)`` on a parser of its own: the flags that give
    another process ``config`` (``spec``: the ``ConfigFlags`` options its command line uses)."""
    return ConfigFlags(argparse.ArgumentParser(add_help=False), cls, **spec).argv(config)


def _text(value: Any) -> str:
    if value is None:
        return NONE
    if isinstance(value, enum.Enum):
        return str(value.value)
    return str(value)


class _DeferredFlagsParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that runs its pending ``add`` callbacks before it first parses or
    formats help (see ``add_flags_later``)."""

    _pending: list[Callable[[argparse.ArgumentParser], None]]

    def _complete(self) -> None:
        while self._pending:
            self._pending.pop(0)(self)

    def parse_known_args(self, args=None, namespace=None):
        self._complete()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self._complete()
        return super().format_usage()

    def format_help(self) -> str:
        self._complete()
        return super().format_help()


def add_flags_later(parser: argparse.ArgumentParser, add: Callable[[argparse.ArgumentParser], None]) -> None:
    """Call ``add(parser)`` when ``parser`` is first used (parses, or prints help), not now.

    For a subcommand whose config classes are expensive to import (their modules import torch):
    building the whole command line then costs nothing for the other subcommands or ``--help``.
    """
    if not isinstance(parser, _DeferredFlagsParser):
        if type(parser) is not argparse.ArgumentParser:
            raise TypeError(f"add_flags_later needs a plain ArgumentParser, not {type(parser).__name__}")
        parser.__class__ = _DeferredFlagsParser  # NOTE: same layout; only the three methods above differ
        parser._pending = []
    parser._pending.append(add)
