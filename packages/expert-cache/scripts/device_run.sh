#!/usr/bin/env bash
# Run on the GPU machine from the repository root (device tool): the gpu-marked tests, then the GPU benchmark.
# The package is pure Python: it runs from its source tree (PYTHONPATH), nothing is installed.
set -uo pipefail
OUT="${OUT:-/tmp/expert-cache-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/packages/expert-cache/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -m pytest packages/expert-cache/tests -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
rc_tests=${PIPESTATUS[0]}
python3 packages/expert-cache/benches/bench_gpu.py --vram-gb 24 --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_gpu.log"
rc_bench=${PIPESTATUS[0]}
echo "gpu tests rc=$rc_tests bench rc=$rc_bench"
exit $(( rc_tests != 0 || rc_bench != 0 ))
