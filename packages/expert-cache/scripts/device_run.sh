#!/usr/bin/env bash
# Run on the GPU machine from the repository root (device tool): the gpu-marked tests, then the GPU benchmark.
# The package is pure Python: it runs from its source tree (PYTHONPATH), nothing is installed. It imports
# cpu_tier.geometry (pure Python; cpu-tier's native kernels are not needed, so not built); the GPU tests register
# host mappings through dma_prefill._cudart (pure Python over torch's cudart). Both source trees go on the path,
# with minimal dist-infos because the packages look up their installed versions.
#   [PYTEST_K=expr] [BENCH=0] bash packages/expert-cache/scripts/device_run.sh
set -uo pipefail
OUT="${OUT:-/tmp/expert-cache-out}"
mkdir -p "$OUT"
SITE="$(mktemp -d)"
for pair in cpu-tier:cpu_tier dma-prefill:dma_prefill; do
    mkdir -p "$SITE/${pair#*:}-0.1.0.dist-info"
    printf 'Metadata-Version: 2.1\nName: %s\nVersion: 0.1.0\n' "${pair%%:*}" > "$SITE/${pair#*:}-0.1.0.dist-info/METADATA"
done
export PYTHONPATH="$PWD/packages/expert-cache/src:$PWD/packages/cpu-tier/src:$PWD/packages/dma-prefill/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -m pytest packages/expert-cache/tests -m gpu -q -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 \
    | tee "$OUT/gpu_tests.log"
rc_tests=${PIPESTATUS[0]}
rc_bench=0
if [ "${BENCH:-1}" != 0 ]; then
    python3 packages/expert-cache/benches/bench_gpu.py --vram-gb 24 --json "$OUT/bench_gpu.json" 2>&1 \
        | tee "$OUT/bench_gpu.log"
    rc_bench=${PIPESTATUS[0]}
fi
echo "gpu tests rc=$rc_tests bench rc=$rc_bench"
exit $(( rc_tests != 0 || rc_bench != 0 ))
