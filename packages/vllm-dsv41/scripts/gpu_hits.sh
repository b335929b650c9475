#!/usr/bin/env bash
# vllm-dsv41 hits on the device machine, in ONE call: exllamav3 staged (when .exl3 is carried and /tmp/exl3site is
# not there yet; see gpu_stage_exl3.sh), the gpu tests of the hits, then benches/bench_hits.py. Needs the gpu-vllm
# kit staged with the project wheels (cpu-tier and engram-mmap are native: their cp312 wheels come from there); the
# carried tree's pure-Python packages (vllm-dsv41, dma-prefill, expert-cache) go first on the path, so the hits
# code measured is the tree's even if the kit's wheels are older. Logs under $OUT.
#   carry [".exl3"] (first time on a machine), then:  bash packages/vllm-dsv41/scripts/gpu_hits.sh
#   (at most 240 + 60 s of tests + 330 s of bench, cut to the call's 585 s: one call of <= 600 s)
#   STEPS="tests bench" (default), BENCH_ARGS="--tokens 1 8 --runs 50" (extra bench_hits.py arguments)
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/dsv41-out}
mkdir -p "$OUT"
STEPS=${STEPS:-"tests bench"}
step() {  # asked for, and at least 30 s of the call left (gpu_env.sh)
    case " $STEPS " in *" $1 "*) ;; *) return 1;; esac
    gpu_time_ok 30 || { log "$1: SKIPPED, $(gpu_left) s left of the call"; rc=1; return 1; }
}
log() { echo "[gpu_hits $(date +%T)] $*" | tee -a "$OUT/hits_steps.log"; }
[ -f /tmp/gpuvllm/INFO.txt ] || { log "the gpu-vllm kit is not staged (no /tmp/gpuvllm/INFO.txt, written after its last part): stage every part first"; exit 2; }
source packages/vllm-dsv41/scripts/gpu_env.sh  # (stages exllamav3 from a carried .exl3 the first time)
export PYTHONPATH="$PWD/packages/vllm-dsv41/src:$PWD/packages/dma-prefill/src:$PWD/packages/expert-cache/src:$PYTHONPATH"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,pcie.link.gen.max,pcie.link.width.max \
    --format=csv,noheader | tee -a "$OUT/hits_steps.log"
python3 -c "import torch, triton, vllm_dsv41.hits as h; from vllm_dsv41.dense import exllamav3_available as a
print('torch', torch.__version__, '| triton', triton.__version__, '| hits from', h.__file__, '| exllamav3', a())" \
    2>&1 | tee -a "$OUT/hits_steps.log"
rc=0
if step tests; then
    log "tests"
    timeout "$(gpu_tmo 240)" python3 -m pytest packages/vllm-dsv41/tests/test_vllm_dsv41_hits_gpu.py -m gpu -q -p no:cacheprovider \
        -W ignore::DeprecationWarning 2>&1 | tee "$OUT/pytest_hits_gpu.log" | tail -25
    r=${PIPESTATUS[0]}; log "tests rc=$r"; rc=$((rc || r))
    # dma-prefill's decode kernels (the prefill's decode shares the group decode), bit for bit
    timeout "$(gpu_tmo 60)" python3 -m pytest packages/dma-prefill/tests/test_dma_prefill_gpu.py -m gpu -q \
        -p no:cacheprovider -k "decode_bit_exact" 2>&1 | tee "$OUT/pytest_decode_gpu.log" | tail -5
    r=${PIPESTATUS[0]}; log "decode tests rc=$r"; rc=$((rc || r))
fi
if step bench; then
    log "bench"
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
    timeout "$(gpu_tmo 330)" python3 packages/vllm-dsv41/benches/bench_hits.py --json "$OUT/bench_hits.json" ${BENCH_ARGS:-} \
        2>&1 | tee "$OUT/bench_hits.log"
    r=${PIPESTATUS[0]}; log "bench rc=$r"; rc=$((rc || r))
fi
log "done rc=$rc"
exit $rc
