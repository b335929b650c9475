#!/usr/bin/env bash
# Device-machine entry point for dma-prefill: the gpu-marked tests, then the H200 benchmark.
# Run from anywhere:  [KERNEL_TUNE=1] [BENCH=0] [PYTEST_K=expr] [CPU_TIER_BUILD=0] bash packages/dma-prefill/scripts/run_gpu.sh [bench_prefill.py args]
# Results land in $OUT (the device tool's folder) or /tmp/dma-prefill-out.
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT="${OUT:-/tmp/dma-prefill-out}"
mkdir -p "$OUT"
# cpu_tier and dma_prefill look up their installed version; the source trees get a minimal dist-info
SITE="$(mktemp -d)"
for pair in cpu-tier:cpu_tier dma-prefill:dma_prefill; do  # (cpu_tier's is dropped below: pip writes a real one)
    mkdir -p "$SITE/${pair#*:}-0.1.0.dist-info"
    printf 'Metadata-Version: 2.1\nName: %s\nVersion: 0.1.0\n' "${pair%%:*}" > "$SITE/${pair#*:}-0.1.0.dist-info/METADATA"
done
# the native cpu-tier (the CPU tail's kernels), built here from the tree: needs the nanobind and
# scikit-build-core wheels in .whl (carry=[".whl"], see packages/cpu-tier/README.md)
if [ "${CPU_TIER_BUILD:-1}" = 0 ]; then  # (then the CPU-tail test cannot load the native tier)
    export PYTHONPATH="packages/dma-prefill/src:packages/cpu-tier/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
bash packages/cpu-tier/scripts/build_native.sh "$OUT/cpu_tier_build.log" --target /tmp/ctsite --emu OFF || exit 1
rm -rf "$SITE/cpu_tier-0.1.0.dist-info"
export PYTHONPATH="packages/dma-prefill/src:/tmp/ctsite:$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,pcie.link.gen.current,pcie.link.width.current --format=csv
python3 -m pytest packages/dma-prefill/tests -m gpu -q -s -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$OUT/pytest_gpu.log"
rc=${PIPESTATUS[0]}
rc2=0
if [ "${BENCH:-1}" != 0 ]; then
    python3 packages/dma-prefill/scripts/bench_prefill.py --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
    rc2=${PIPESTATUS[0]}
fi
rc3=0
if [ -n "${KERNEL_TUNE:-}" ]; then  # per-kernel timings over tile configs (scripts/kernel_tune.py)
    python3 packages/dma-prefill/scripts/kernel_tune.py --json "$OUT/kernel_tune.json" 2>&1 | tee "$OUT/kernel_tune.log"
    rc3=${PIPESTATUS[0]}
fi
echo "pytest rc=$rc bench rc=$rc2 kernel_tune rc=$rc3"
exit $(( rc || rc2 || rc3 ))
