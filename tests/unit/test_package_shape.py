"""The package's shape, as docs/architecture.md states it: no import circle inside ``triptych/`` (imports inside
functions count too), imports between its top-level packages pointing one way down the declared layers, and no
module over 500 lines. ``pytest tests/unit/test_package_shape.py -s`` prints the package graph."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import triptych

ROOT = Path(triptych.__file__).parent
#: Past ~500 lines a module is usually two ideas: the count flags it for a look, it is never where
#: to cut (a satellite split off to stay under a number is worse than one longer file).
MAX_LINES = 500


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


# Bottom to top. A package imports only packages of lower tiers: none of its own tier, none above.
TIERS = (
    ("core",),  # errors, identity, devices, media codecs, owner-only files
    ("mmcache", "accel", "parallel", "transfer"),  # mechanisms, each on core alone
    ("lora", "chat"),  # per-row adapters (their deltas gathered as parallel gathers outputs); the chat engine
    ("families",),  # the stage protocol and the model families
    ("engine", "plan"),  # step batching, the in-process driver, TeaCache per family; FLOPs and memory counted on meta
    ("vllm_chat", "control"),  # the vLLM chat client; head <-> worker messages, backends, routing, registry
    ("worker", "head", "deploy"),  # the worker process; the HTTP app; supervisor, Ray, autoscale
    ("calibration", "sim"),  # TeaCache calibration and quality reports; the head's scheduler on a virtual clock
    ("cli",),  # the triptych command
)


def tier_of() -> dict[str, int]:
    return {pkg: i for i, names in enumerate(TIERS) for pkg in names}


def package_graph() -> dict[str, set[str]]:
    """Top-level package of ``triptych`` -> the top-level packages its modules import (``triptych/__init__`` is
    the node ``triptych``)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}

    def top(m: str) -> str:
        return m.split(".")[1] if m.count(".") else m

    for m, p in mods.items():
        graph.setdefault(top(m), set()).update(top(t) for t in _imports(m, p, mods) if top(t) != top(m))
    return graph


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    tier = tier_of()
    out = [f"{a}: not in TIERS (place it)" for a in sorted(graph) if a not in tier and a != "triptych"]
    out += [
        f"{a} (tier {tier[a]}) imports {b} (tier {tier[b]})"
        for a in sorted(graph)
        for b in sorted(graph[a])
        if a in tier and b in tier and tier[b] >= tier[a]
    ]
    return out


def test_package_graph_points_down_the_layers():
    graph = package_graph()
    tier = tier_of()
    print("\npackage graph (tier: package -> what it imports):")
    for a in sorted(graph, key=lambda n: (tier.get(n, -1), n)):
        print(f"  {tier.get(a, '?')}: {a} -> {', '.join(sorted(graph[a], key=lambda n: (tier.get(n, -1), n))) or '-'}")
    assert layer_violations(graph) == []


def test_the_layer_check_finds_an_upward_edge_and_a_stray_package(tmp_path, monkeypatch):
    pkg = tmp_path / "triptych"
    for name in ("core", "cli", "stray"):
        (pkg / name).mkdir(parents=True)
        (pkg / name / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("def f():\n    from triptych.cli import main\n")
    (pkg / "cli" / "main.py").write_text("from triptych.core import a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    assert layer_violations(package_graph()) == ["stray: not in TIERS (place it)", "core (tier 0) imports cli (tier 8)"]


def test_the_shape_world_and_training_stay_outside_the_runtime():
    """``shapeworld`` (shipped beside ``triptych``) imports nothing of it; nothing shipped imports ``training``."""
    import shapeworld

    world = [
        p
        for p in Path(shapeworld.__file__).parent.rglob("*.py")
        if any(n.startswith(("triptych", "training")) for n in _top_imports(p))
    ]
    runtime = [p for p in ROOT.rglob("*.py") if any(n.startswith("training") for n in _top_imports(p))]
    assert (world, runtime) == ([], [])


def _top_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
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


def test_no_module_over_500_lines():
    long = {
        str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
