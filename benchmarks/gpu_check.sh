#!/usr/bin/env bash
# The one GPU check, about 7.5 minutes on a one-H200 machine (first run 2026-12-04, steps 1-3: 397 s;
# benchmarks/RESULTS.md):
#   1. install the carried wheels (benchmarks/gpu_wheels/, from benchmarks/fetch_gpu_wheels.sh) into a
#      private folder with --no-deps --target (the machine's own CUDA torch is kept; nothing is fetched),
#   2. run the gpu-marked tests (placement, bf16 staged vs diffusers on the device, roles split through
#      host staging, attention backends, offload, pinned transfer staging, --compile and int8/fp8
#      --quantize on the device, --cuda-graphs), printing measured figures,
#   3. run benchmarks/gpu_bench.py (full-size FLUX / Qwen-Image / Wan transformers built on the device
#      with random weights; Triptych step batching vs diffusers batched and sequential) and print its table,
#   4. run benchmarks/compile_quant.py --device cuda (the default model: --compile vs eager vs diffusers'
#      __call__ on the device, synchronized wall time; the GPU figure of --compile's speed).
# Usage, from the repository root on the GPU machine:  bash benchmarks/gpu_check.sh
# Caps: wheels ~20 s + tests 300 s (the compile and CUDA graph tests each compile the default model on
# the device; all tests took 214 s on the first run, before the CUDA graph test) + benchmark 140 s
# (BENCH_BUDGET_S 90; 154 s measured at 120) + compile benchmark 100 s: 560 s at the caps, ~470 s expected.
# Env: PY (default /opt/torch/.venv/bin/python), WHEELS (default benchmarks/gpu_wheels), BENCH_BUDGET_S
# (default 90), BENCH_ARGS (extra gpu_bench flags; a CPU dry run: BENCH_ARGS="--device cpu --tiny"),
# TESTS (pytest arguments, default the three gpu test files; a rerun of one: TESTS=tests/...::test_x),
# BENCH (0: skip steps 3 and 4).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
PY="${PY:-/opt/torch/.venv/bin/python}"
site="${TMPDIR:-/tmp}/triptych-gpu-site"
start=$SECONDS
status=0

echo "== 1/4 wheels -> $site"
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

echo "== 2/4 gpu-marked tests"
# shellcheck disable=SC2086
timeout 300 "$PY" -m pytest -q -s -m gpu -p no:cacheprovider \
    ${TESTS:-tests/pipelines/test_gpu.py tests/pipelines/test_gpu_speed.py tests/unit/test_transfer_staging.py} || status=1
echo "   $((SECONDS - start)) s"

if [ "${BENCH:-1}" = 0 ]; then echo "== done in $((SECONDS - start)) s, status $status (benchmark skipped)"; exit $status; fi
echo "== 3/4 benchmark"
# shellcheck disable=SC2086
timeout 140 "$PY" benchmarks/gpu_bench.py --device cuda --budget-s "${BENCH_BUDGET_S:-90}" ${BENCH_ARGS:-} || status=1
echo "== 4/4 --compile on the device"
timeout 100 "$PY" benchmarks/compile_quant.py --device cuda --repeats 2 --variants compile --no-diffusers-compiled \
    | grep -E '^(\||matmul)' || status=1
echo "== done in $((SECONDS - start)) s, status $status"
exit $status
