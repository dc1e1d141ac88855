#!/usr/bin/env bash
# Installs Triptych into ./.venv: torch 2.13.0 (CPU wheel) first and on its own, then the package
# with its test, Mooncake and Ray extras (so CI runs the Ray tests, which skip without Ray).
# Mooncake's engine needs libibverbs1 from Debian (root only). With --vllm (or TRIPTYCH_VLLM=1) it
# also runs ./install_vllm.sh: vLLM in its own .venv-vllm, for `triptych serve --chat-engine vllm`.
# With --quant (or TRIPTYCH_QUANT=1) it adds the quant extra (torchao) for `--quantize`.
set -euo pipefail
cd "$(dirname "$0")"
VLLM=${TRIPTYCH_VLLM:-0}
QUANT=${TRIPTYCH_QUANT:-0}
for arg in "$@"; do
  case "$arg" in
    --vllm) VLLM=1 ;;
    --quant) QUANT=1 ;;
    *) echo "install.sh: unknown argument $arg (known: --vllm, --quant)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! ldconfig -p | grep -q libibverbs.so.1; then
  (apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null) || echo "install.sh: libibverbs1 not installed; Mooncake transfer will be unavailable" >&2
fi
# Headless Chromium renders the HTML quality reports in tests (skipped without it); root only.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && [ ! -x /usr/bin/chromium ]; then
  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "install.sh: chromium not installed; the report-render test will be skipped" >&2
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e ".[test,mooncake,ray]"
if [ "$QUANT" = 1 ]; then
  .venv/bin/pip install -q -e ".[quant]"
fi
.venv/bin/python -c "import torch, triptych; assert torch.__version__.startswith('2.13.0'), torch.__version__"
echo "install.sh: Triptych installed in $(pwd)/.venv"
if [ "$VLLM" = 1 ]; then
  PYTHON="$PY" ./install_vllm.sh
fi
