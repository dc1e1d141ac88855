"""The HTTP head imports without torch, transformers or diffusers: ``triptych.head.app`` and every other module
of ``triptych.head`` (its routes, state, config, ``serve``), and the torch-free modules it takes its values from
(docs/architecture.md, "The HTTP head", says which edge would pull them in, and why it does not)."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import triptych.head

HEAVY = ("torch", "transformers", "diffusers")
VALUES = (
    "triptych.core.media",
    "triptych.chat.params",
    "triptych.families.params",
    "triptych.families.teacache_check",
    "triptych.control.backend",
)

# Run in a fresh interpreter: a finder placed first refuses the heavy packages and records the chain of
# triptych files whose imports asked for each (a refusal an ``except ImportError`` swallows is still recorded).
PROBE = """
import importlib, json, sys, traceback
heavy, wanted = set(sys.argv[1].split(",")), sys.argv[2:]
asked = []

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in heavy:
            chain = [f.filename.split("/triptych/", 1)[-1] for f in traceback.extract_stack() if "/triptych/" in f.filename]
            asked.append(name + " <- " + " <- ".join(reversed(chain)))
            raise ModuleNotFoundError(name)
        return None

sys.meta_path.insert(0, Refuse())
for module in wanted:
    try:
        importlib.import_module(module)
    except ImportError as e:
        asked.append(f"{module}: {e!r}")
print(json.dumps({"asked": asked, "loaded": sorted(m for m in heavy if m in sys.modules)}))
"""


def head_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(triptych.head.__path__, "triptych.head."))


def imports_of(modules) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", PROBE, ",".join(HEAVY), *modules], capture_output=True, text=True, check=True
    )
    return json.loads(run.stdout)


def test_the_head_and_its_routes_import_no_torch_transformers_or_diffusers():
    modules = head_modules()
    assert {"triptych.head.app", "triptych.head.serve", "triptych.head.routes_common"} <= set(modules)
    out = imports_of([*modules, *VALUES])
    assert out == {"asked": [], "loaded": []}, "\n".join(out["asked"])


def test_the_probe_names_the_chain_that_asks_for_torch():
    out = imports_of(["triptych.chat.vlm"])  # a module that needs torch: what a regression looks like
    assert out["loaded"] == []
    assert any(a.startswith("torch <- ") and "chat/vlm.py" in a for a in out["asked"]), out["asked"]
