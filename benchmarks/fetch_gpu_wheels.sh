#!/usr/bin/env bash
# Download the cp312 manylinux wheels benchmarks/gpu_check.sh installs on the GPU machine (which cannot
# reach a registry) into benchmarks/gpu_wheels/ (git-ignored). Run here, where pip can reach PyPI:
#     benchmarks/fetch_gpu_wheels.sh [PIP]
# Fails when the folder and the tracked tree together exceed 64 MiB (what one device run may carry).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
pip="${1:-pip}"
out="$here/gpu_wheels"
mkdir -p "$out"
grep -vE '^\s*(#|$)' "$here/gpu_wheels.txt" | xargs "$pip" download --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform any -d "$out" --quiet
bytes=$(du -sb "$out" | cut -f1)
tree=$(cd "$here/.." && git ls-files -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
echo "$(ls "$out" | wc -l) wheels, $((bytes / 1048576)) MiB in $out; with the tracked tree $(((bytes + tree) / 1048576)) MiB"
if [ $((bytes + tree)) -gt $((64 * 1048576)) ]; then echo "over the 64 MiB a device run carries" >&2; exit 1; fi
