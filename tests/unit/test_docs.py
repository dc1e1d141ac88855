"""The README is a short front door and the pages behind it stay true to the tree.

- README.md is at most 200 lines, and its first screen holds the install-and-generate command and
  the test command ``.ci/run`` runs.
- Every page in docs/ is linked from the README and opens with a one-line summary under its title.
- Every relative link in README.md and docs/*.md resolves inside the repository (none names ../shared).
- No docstring or comment of the code cites a document outside the repository, and none in
  ``triptych/`` carries a time measurement (figures live in benchmarks/RESULTS.md).
- Every file or folder of the repository they name (``triptych/...py``, ``tests/...``, ``head/x.py``
  for ``triptych/head/x.py``, a bare ``x.py`` somewhere in the tree) exists, and every
  ``path.py::name`` and ``module.name`` naming a triptych module (``triptych.mmcache.cache.tenant_scope``,
  ``mmcache.cache.tenant_scope``, ``worker/ranks/ticks.py``) names something that module defines.
"""

from __future__ import annotations

import ast
import functools
import itertools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_README_LINES = 200
FIRST_SCREEN = 40  # lines
INSTALL_AND_GENERATE = (
    './install.sh && .venv/bin/triptych generate --prompt "a red circle on a blue background" --out a.png'
)
TEST_COMMAND = ".venv/bin/python -m pytest -q"
SEARCHED = ("triptych", "tests", "benchmarks")  # where a bare file name is looked for
# git-ignored outputs the pages name, made by a script (benchmarks/fetch_gpu_wheels.sh), not in a checkout
GENERATED = frozenset({"benchmarks/gpu_wheels/"})

LINK = re.compile(r"\]\(([^)\s]+)\)")
SPAN = re.compile(r"`([^`\n]+)`")
# a repository path anywhere (code blocks included), not part of a longer path such as ~/.cache/triptych/
ROOTED = re.compile(r"(?<![\w/.$~-])((?:triptych|tests|benchmarks|docs|\.ci)/[\w./{},-]*)")
PATH = re.compile(r"^([\w./{},-]*\.(?:py|sh|md|html|json|yaml|png))(?:::([\w.]+))?$")
DOTTED = re.compile(r"^[A-Za-z_][\w/]*(?:\.[A-Za-z_]\w*)+$")


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def texts() -> dict[Path, str]:
    return {p: p.read_text() for p in [README, *pages()]}


def expand(path: str) -> list[str]:
    """``test_{flux,wan}.py`` -> both names."""
    parts = re.split(r"\{([^}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


@functools.cache
def bare_files() -> frozenset[str]:
    return frozenset(p.name for root in SEARCHED for p in (REPO / root).rglob("*") if p.is_file())


def file_for(path: str) -> Path | None:
    """The repository file or folder ``path`` names: from the root, under ``triptych/``, or (a bare
    name) anywhere in the searched folders."""
    if path in GENERATED:
        return REPO / path
    for base in (REPO, REPO / "triptych"):
        if (base / path).exists():
            return base / path
    if "/" not in path.rstrip("/") and path in bare_files():
        return next(p for root in SEARCHED for p in (REPO / root).rglob(path))
    return None


def module_file(parts: list[str]) -> Path | None:
    base = REPO / "triptych" / Path(*parts) if parts else REPO / "triptych"
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if parts and candidate.is_file():
            return candidate
    return None


def defines(path: Path, names: list[str]) -> bool:
    """``names[0]`` is bound at the top of the module (def, class, assignment, import); a second
    name is bound inside that class."""
    body = ast.parse(path.read_text()).body
    for name in names[:2]:
        found = None
        for node in body:
            bound: list[str] = []
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                bound = [node.name]
            elif isinstance(node, ast.Assign):
                bound = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                bound = [node.target.id]
            elif isinstance(node, ast.Import | ast.ImportFrom):
                bound = [(a.asname or a.name).split(".")[0] for a in node.names]
            if name in bound:
                found = node
        if found is None:
            return False
        body = found.body if isinstance(found, ast.ClassDef) else []
    return True


def check_dotted(name: str) -> str | None:
    """None when ``name`` is fine or names no triptych module (``torch.nn``); else what is wrong."""
    parts = name.replace("/", ".").split(".")
    if parts[0] == "triptych":
        parts = parts[1:]
    for i in range(len(parts), 0, -1):
        path = module_file(parts[:i])
        if path is not None:
            rest = parts[i:]
            if rest and not defines(path, rest):
                return f"{path.relative_to(REPO)} does not define {'.'.join(rest)}"
            return None
    return f"no module triptych.{'.'.join(parts)}" if name.startswith("triptych.") else None


def problems(text: str) -> list[str]:
    out = []
    for rooted in ROOTED.findall(text):
        for path in expand(rooted.rstrip(".,")):
            if file_for(path) is None:
                out.append(f"{path}: no such file or folder")
    for span in SPAN.findall(text):
        span = span.strip()
        if "<" in span or "*" in span or " " in span:
            continue
        if m := PATH.match(span):
            for path in expand(m.group(1)):
                found = file_for(path)
                if found is None:
                    out.append(f"{path}: no such file")
                elif m.group(2) and found.suffix == ".py" and not defines(found, m.group(2).split(".")):
                    out.append(f"{path} does not define {m.group(2)}")
        elif span.endswith("/") and re.fullmatch(r"[\w./-]+/", span):
            if file_for(span) is None and (span.split("/")[0] in {p.name for p in (REPO / "triptych").iterdir()}):
                out.append(f"{span}: no such folder")
        elif DOTTED.match(span) and (why := check_dotted(span)) is not None:
            out.append(why)
    return sorted(set(out))


def test_the_readme_is_at_most_200_lines():
    assert len(README.read_text().splitlines()) <= MAX_README_LINES


def test_the_first_screen_holds_the_two_commands_and_ci_runs_the_readmes_test_command():
    first = "\n".join(README.read_text().splitlines()[:FIRST_SCREEN])
    assert INSTALL_AND_GENERATE in first
    assert f"```bash\n{TEST_COMMAND}\n```" in first
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert "./install.sh" in ci, ".ci/run does not run the README's install as written"
    assert any(line == TEST_COMMAND or line.endswith(" " + TEST_COMMAND) for line in ci), (
        ".ci/run does not run the README's test command as written"
    )


def test_every_docs_page_is_linked_from_the_readme_and_opens_with_one_line_saying_what_it_covers():
    linked = set(LINK.findall(README.read_text()))
    assert pages()
    for page in pages():
        assert f"docs/{page.name}" in linked, f"README.md does not link {page.name}"
        lines = page.read_text().splitlines()
        assert lines[0].startswith("# ") and lines[1] == "", page.name
        assert lines[2] and not lines[2].startswith(("#", "- ", "|", "```", "![")), page.name
        assert lines[3] == "", f"{page.name}: its summary is one line"


def test_every_relative_link_resolves_inside_the_repository():
    for path, text in texts().items():
        assert "../shared" not in text, f"{path.name} points at ../shared, which is not in the repository"
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            resolved = (path.parent / target.split("#")[0]).resolve()
            assert resolved.is_relative_to(REPO), f"{path.name} links outside the repository: {target}"
            assert resolved.exists(), f"{path.name}: broken link {target}"


def test_every_path_and_name_the_docs_give_exists():
    found = {path.name: problems(text) for path, text in texts().items()}
    assert {name: p for name, p in found.items() if p} == {}


def test_the_check_finds_a_missing_module_file_and_name():
    assert problems("`triptych/head/app.py`, `head/app.py::create_app`, `mmcache.cache.tenant_scope`") == []
    assert problems("see triptych/nowhere.py") == ["triptych/nowhere.py: no such file or folder"]
    assert problems("`head/app.py::no_such_function`") == ["head/app.py does not define no_such_function"]
    assert problems("`mmcache.cache.no_such_name`") == ["triptych/mmcache/cache.py does not define no_such_name"]
    assert problems("`torch.nn.Linear`, `~/.cache/triptych/x`") == []


#: a document that is not in the repository (ours, beside it), or a numbered contract of one
OUTSIDE = re.compile(r"ARCHITECTURE\.md|STYLE\.md|ENVIRONMENT\.md|\.\./shared|\b[Cc]ontract \d+\b")
#: a time measurement: "2.4 ms", "379 µs", "1.85 -> 1.79"
FIGURE = re.compile(r"\b\d[\d.,]*\s?(?:ms|µs|us)\b|\b\d[\d.]*\s?(?:ms|µs|us|s)?\s?(?:->|→)\s?\d")


def prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python file."""
    import tokenize

    out = []
    with path.open("rb") as f:
        for tok in tokenize.tokenize(f.readline):
            if tok.type == tokenize.COMMENT:
                out.append((tok.start[0], tok.string))
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    out.append((body[0].lineno, body[0].value.value))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.append((node.lineno, node.value.value))  # attribute docstrings
    return out


def prose_problems(paths, pattern) -> list[str]:
    found = []
    for path in paths:
        for line, text in prose(path):
            for m in pattern.finditer(text):
                shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
                found.append(f"{shown}:{line}: {m.group(0)!r}")
    return sorted(set(found))


def python_files(*roots: str) -> list[Path]:
    return sorted(p for root in roots for p in (REPO / root).rglob("*.py") if ".venv" not in p.parts)


def test_no_code_cites_a_document_outside_the_repository():
    own = Path(__file__).resolve()
    paths = [p for p in python_files("triptych", "tests", "benchmarks", "shapeworld", "training") if p != own]
    assert prose_problems(paths, OUTSIDE) == []


def test_no_docstring_or_comment_in_the_package_carries_a_time_measurement():
    assert prose_problems(python_files("triptych"), FIGURE) == []


def test_the_prose_checks_find_a_citation_and_a_figure(tmp_path):
    bad = tmp_path / "probe.py"
    outside = "ARCHITECTURE" + ".md"  # split, so this file does not cite it itself
    bad.write_text(f'"""As {outside} says."""\n\n\ndef f():\n    """Takes 2.4 ms."""\n    # 1.85 -> 1.79\n')
    assert len(prose_problems([bad], OUTSIDE)) == 1
    assert len(prose_problems([bad], FIGURE)) == 2
