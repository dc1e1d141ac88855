"""The package's shape, as docs/architecture.md states it: no import circle inside ``triptych/`` (imports inside
functions count too) and no module over 400 lines."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import triptych

ROOT = Path(triptych.__file__).parent
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("triptych", *path.relative_to(ROOT).with_suffix("").parts))
        mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    out = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in out if m in mods and m != name}


def import_circles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_inside_the_package():
    assert import_circles() == []


def test_the_check_finds_a_circle(tmp_path, monkeypatch):
    """The checker itself can fail: two modules importing each other are reported."""
    pkg = tmp_path / "triptych"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from triptych import b\n")
    (pkg / "b.py").write_text("def f():\n    from triptych.a import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    assert import_circles() == [["triptych.a", "triptych.b"]]


def test_no_module_over_400_lines():
    long = {
        str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
