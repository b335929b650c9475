#!/usr/bin/env bash
# Run on the GPU machine from the repository root (device tool): the gpu-marked tests, then the GPU benchmark.
# The package is pure Python: it runs from its source tree (PYTHONPATH), nothing is installed. It imports
# cpu_tier.geometry (pure Python; cpu-tier's native kernels are not needed, so not built): cpu-tier's source tree
# goes on the path too, with a minimal dist-info because cpu_tier looks up its installed version.
set -uo pipefail
OUT="${OUT:-/tmp/expert-cache-out}"
mkdir -p "$OUT"
SITE="$(mktemp -d)"
mkdir -p "$SITE/cpu_tier-0.1.0.dist-info"
printf 'Metadata-Version: 2.1\nName: cpu-tier\nVersion: 0.1.0\n' > "$SITE/cpu_tier-0.1.0.dist-info/METADATA"
export PYTHONPATH="$PWD/packages/expert-cache/src:$PWD/packages/cpu-tier/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -m pytest packages/expert-cache/tests -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
rc_tests=${PIPESTATUS[0]}
python3 packages/expert-cache/benches/bench_gpu.py --vram-gb 24 --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_gpu.log"
rc_bench=${PIPESTATUS[0]}
echo "gpu tests rc=$rc_tests bench rc=$rc_bench"
exit $(( rc_tests != 0 || rc_bench != 0 ))
