#!/usr/bin/env bash
# The one GPU check, under 8 minutes on one H100 or H200 at its caps (20 + 180 + 260 s):
#   1. install the carried wheels (benchmarks/gpu_wheels/, from benchmarks/fetch_gpu_wheels.sh) into a
#      private folder with --no-deps --target (the machine's own CUDA torch is kept; nothing is fetched),
#   2. run the gpu-marked tests (placement, bf16 staged vs diffusers on the device, roles split through
#      host staging, attention backends, offload, pinned transfer staging, --step-graphs replays vs eager
#      and their byte bound, --attention auto vs native (tiny models: seconds), --compile and int8/fp8
#      --quantize on the device, --cuda-graphs), printing measured figures,
#   3. run benchmarks/gpu_mfu.py: the MFU table (full-size FLUX / Qwen-Image / Wan transformers built on
#      the device with random bf16 weights; Triptych's step eager, --step-graphs (FLUX 256² batch 1
#      first), native attention against auto, --compile, --compile --cuda-graphs and fp8 beside
#      diffusers plain and with its regional compile; FLOPs counted by FlopCounterMode, peaks
#      from triptych.plan.peaks), row by row, most important cell first, within its time budget.
# Optional: STEP_BATCHING=1 adds benchmarks/gpu_bench.py (step batching vs diffusers batched and
# sequential), COMPILE_QUANT=1 adds benchmarks/compile_quant.py --device cuda (the default model).
# Usage, from the repository root on the GPU machine:  bash benchmarks/gpu_check.sh
# Env: PY (default /opt/torch/.venv/bin/python), WHEELS (default benchmarks/gpu_wheels), MFU_BUDGET_S
# (default 200), MFU_ARGS (extra gpu_mfu flags; a CPU dry run: MFU_ARGS="--device cpu --tiny"),
# TESTS (pytest arguments, default the four gpu test files; a rerun of one: TESTS=tests/...::test_x),
# BENCH (0: skip step 3 and the optional ones).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
PY="${PY:-/opt/torch/.venv/bin/python}"
site="${TMPDIR:-/tmp}/triptych-gpu-site"
start=$SECONDS
status=0

echo "== 1/3 wheels -> $site"
wheels=("${WHEELS:-benchmarks/gpu_wheels}"/*.whl)
if [ ! -e "${wheels[0]}" ]; then echo "no wheels in benchmarks/gpu_wheels/: run benchmarks/fetch_gpu_wheels.sh first" >&2; exit 2; fi
rm -rf "$site" && mkdir -p "$site"
if ! "$PY" -m pip install --no-deps --no-index --no-compile --target "$site" --quiet "${wheels[@]}"; then
    echo "pip unavailable or failed: unpacking the wheels instead"
    for w in "${wheels[@]}"; do "$PY" -m zipfile -e "$w" "$site"; done
fi
export PYTHONPATH="$root:$site"
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error DIFFUSERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
nvidia-smi -L 2>/dev/null || true
"$PY" -c "import torch, diffusers, transformers, msgspec, zmq; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count(), '| diffusers', diffusers.__version__, '| transformers', transformers.__version__)" || exit 2
echo "   $((SECONDS - start)) s"

echo "== 2/3 gpu-marked tests"
# shellcheck disable=SC2086
# -o addopts: the project's xdist workers are not wanted (nor installed) here
timeout 180 "$PY" -m pytest -q -s -m gpu -p no:cacheprovider -o addopts=-ra \
    ${TESTS:-tests/pipelines/test_gpu.py tests/pipelines/test_gpu_step_graphs.py tests/pipelines/test_gpu_speed.py tests/unit/test_transfer_staging.py} || status=1
echo "   $((SECONDS - start)) s"

if [ "${BENCH:-1}" = 0 ]; then echo "== done in $((SECONDS - start)) s, status $status (benchmarks skipped)"; exit $status; fi
echo "== 3/3 MFU table"
# shellcheck disable=SC2086
timeout 260 "$PY" benchmarks/gpu_mfu.py --device cuda --budget-s "${MFU_BUDGET_S:-200}" ${MFU_ARGS:-} || status=1
if [ "${STEP_BATCHING:-0}" = 1 ]; then
    echo "== step batching vs diffusers"
    timeout 140 "$PY" benchmarks/gpu_bench.py --device cuda --budget-s 90 || status=1
fi
if [ "${COMPILE_QUANT:-0}" = 1 ]; then
    echo "== --compile on the device (default model)"
    timeout 100 "$PY" benchmarks/compile_quant.py --device cuda --repeats 2 --variants compile --no-diffusers-compiled \
        | grep -E '^(\||matmul)' || status=1
fi
echo "== done in $((SECONDS - start)) s, status $status"
exit $status
