#!/usr/bin/env bash
# Every gpu-marked test of the repository on the device machine, in one call (~5 min): vllm-dsv41 (two halves, as
# run 18's call 8), its Engram gpu tests (gpu_engram.sh), dma-prefill's and expert-cache's. Needs the gpu-vllm kit
# staged (with the project wheels) and .whl carried (dma-prefill builds the native cpu-tier from the tree). One log
# folder per suite under $OUT; the last lines say which suite failed. SUITES picks (default all four, in this order):
#   run(command="bash packages/vllm-dsv41/scripts/gpu_all_tests.sh", carry=[".exl3", ".whl"])
#   SUITES="engram cache" bash packages/vllm-dsv41/scripts/gpu_all_tests.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
export DSV41_CALL_T0=${DSV41_CALL_T0:-$(date +%s)} DSV41_CALL_S=${DSV41_CALL_S:-585}
ROOT_OUT=${OUT:-/tmp/gpu-all-tests}
SUITES=${SUITES:-"dsv41 engram dma cache"}
summary=()
suite() {  # name, command...: run it with OUT=$ROOT_OUT/name, keep its exit status
    local name=$1 r t0
    shift
    mkdir -p "$ROOT_OUT/$name"
    t0=$(date +%s)
    echo "[gpu_all_tests $(date +%T)] $name"
    OUT="$ROOT_OUT/$name" "$@"
    r=$?
    summary+=("$name rc=$r ($(( $(date +%s) - t0 )) s)")
}
for s in $SUITES; do
    case $s in
        dsv41)
            suite dsv41_a env PYTEST_K="tiered or on_the_gpu" STEPS="pack tests" bash packages/vllm-dsv41/scripts/gpu_run.sh
            suite dsv41_b env PYTEST_K="not (tiered or on_the_gpu)" STEPS="pack tests" bash packages/vllm-dsv41/scripts/gpu_run.sh ;;
        engram) suite engram env STEPS="pack tests" bash packages/vllm-dsv41/scripts/gpu_engram.sh ;;
        dma) suite dma env BENCH=0 bash packages/dma-prefill/scripts/run_gpu.sh ;;
        cache) suite cache env BENCH=0 bash packages/expert-cache/scripts/device_run.sh ;;
        *) echo "gpu_all_tests: unknown suite '$s' (dsv41, engram, dma, cache)" >&2; exit 2 ;;
    esac
done
# the device tool brings back at most 8 files of $OUT: the suites' logs but their steps logs travel as one archive,
# the summary beside it
source packages/vllm-dsv41/scripts/gpu_out_bundle.sh
OUT=$ROOT_OUT gpu_out_bundle
printf '%s\n' "${summary[@]}" | tee "$ROOT_OUT/summary.txt"
! grep -qv " rc=0 " "$ROOT_OUT/summary.txt"
