"""The head's config and state modules import without torch (docs/architecture.md, "The HTTP head", says
which part of the head does need it, and why)."""

from __future__ import annotations

import subprocess
import sys

TORCH_FREE = (
    "triptych.head.admission",
    "triptych.head.api_models",
    "triptych.head.state",
    "triptych.core.media",
    "triptych.head.served",
)


def test_head_config_and_state_modules_do_not_import_torch():
    heavy = ("torch", "transformers", "diffusers")
    code = f"import sys\nimport {', '.join(TORCH_FREE)}\nprint(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
