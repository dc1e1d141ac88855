"""What keeps a cold ``triptych`` command short (benchmarks/RESULTS.md, "Cold start"): the parser of
every command is built without the heavy libraries, and the command (not a caller of ``main``)
freezes the heap before it exits, so interpreter shutdown does not sweep what torch loaded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: imported by none of the parsers (``triptych --help``, ``generate --help``, ``serve --help`` lists
#: its flags later): httpx is the vLLM client's, loaded by ``serve --chat-engine vllm`` only.
HEAVY = ("torch", "diffusers", "transformers", "peft", "httpx", "numpy", "PIL", "zmq")


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_building_every_parser_imports_none_of_the_heavy_libraries():
    code = (
        "import sys\nfrom triptych.cli import build_parser\nbuild_parser()\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))"
    )
    assert _run(code) == "[]"


def test_the_command_freezes_the_heap_before_exit_and_a_caller_of_main_keeps_its_own():
    # a generate refused by its checks (before torch): main returns 2 either way
    bad = ["generate", "--prompt", "x", "--out", "a.gif"]
    code = (
        "import gc, json, sys\nfrom triptych.cli import main\n"
        f"called = main({bad!r}); after_call = gc.get_freeze_count()\n"
        f"sys.argv = ['triptych', *{bad!r}]\n"
        "command = main(); after_command = gc.get_freeze_count()\n"
        "print(json.dumps([called, after_call, command, after_command > 0]))"
    )
    assert json.loads(_run(code)) == [2, 0, 2, True]
