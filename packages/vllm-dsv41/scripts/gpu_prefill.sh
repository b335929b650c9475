#!/usr/bin/env bash
# vllm-dsv41 staged prefill on the device machine, in ONE call (<= 600 s): the staged path's fidelity against the
# all-in-VRAM oracle on tiny-v41 (>= 2000 prompt positions, top-1 >= 0.999, mean KL <= 1e-4), then
# benches/bench_prefill.py on a Flash-shaped home of real-size layers with VRAM capped at 24 GiB (prompt tok/s at
# 8k/16k/32k vs the H2D ceiling of the same run, a 100-token call, decode hit rate before/after, peak VRAM).
# Needs the gpu-vllm kit staged (see gpu_hits.sh); the carried tree's pure-Python packages go first on the path.
# Logs under $OUT.
#   bash packages/vllm-dsv41/scripts/gpu_prefill.sh
#   STEPS="fidelity bench" (default), LAYERS=6 (Flash layers in the bench: 5.1 GB of host RAM each, written once
#   under /tmp/dsv41/flash, ~40 s each), BENCH_ARGS="--runs 3" (extra bench_prefill.py arguments)
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/dsv41-out}
mkdir -p "$OUT"
STEPS=${STEPS:-"fidelity bench"}
LAYERS=${LAYERS:-6}
step() {  # asked for, and at least 30 s of the call left (gpu_env.sh)
    case " $STEPS " in *" $1 "*) ;; *) return 1;; esac
    gpu_time_ok 30 || { log "$1: SKIPPED, $(gpu_left) s left of the call"; rc=1; return 1; }
}
log() { echo "[gpu_prefill $(date +%T)] $*" | tee -a "$OUT/prefill_steps.log"; }
[ -f /tmp/gpuvllm/INFO.txt ] || { log "the gpu-vllm kit is not staged (no /tmp/gpuvllm/INFO.txt, written after its last part): stage every part first"; exit 2; }
source packages/vllm-dsv41/scripts/gpu_env.sh
export PYTHONPATH="$PWD/packages/vllm-dsv41/src:$PWD/packages/dma-prefill/src:$PWD/packages/expert-cache/src:$PYTHONPATH"
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader \
    | tee -a "$OUT/prefill_steps.log"
rc=0
if step fidelity; then
    log "fidelity: tiered + staged prefill (calls of >= 64 tokens stream) vs all-in-vram on tiny-v41"
    PACK=/tmp/dsv41/tiny-v41
    if [ ! -f "$PACK/config.json" ]; then  # as gpu_run.sh's pack step: synthesize tiny-v41, build its pack
        python3 - <<'PY' 2>&1 | tail -3
from pathlib import Path
from pack_tools import build_pack
from pack_tools.origin import ENGRAM, EXL3
from pack_tools.presets.tiny_v41 import synth_tiny_v41
root = Path("/tmp/dsv41"); synth_tiny_v41(root / "in")
build_pack(root / "in" / EXL3.dirname, root / "in" / ENGRAM.dirname, root / "tiny-v41", jobs=1, force=True)
PY
    fi
    # --noise-floor: the gate is the oracle's own top-1 under reordered sums (0.994 on tiny-v41 in run 2), not 0.999
    timeout "$(gpu_tmo 300)" python3 -m vllm_dsv41.fidelity "$PACK" --runtime tiered --against all-in-vram \
        --positions 2048 --length 512 --greedy-prompts 2 --greedy-tokens 16 --gpu-memory-gib 24 --noise-floor --min-top1 0.999 --max-kl-mean 1e-4 \
        --tiered '{"prefill_min_tokens": 64, "cache_gib": 0.05}' --json "$OUT/prefill_fidelity.json" \
        2>&1 | tee "$OUT/prefill_fidelity.log" | tail -20
    r=${PIPESTATUS[0]}; log "fidelity rc=$r"; rc=$((rc || r))
fi
if step bench; then
    log "bench: $LAYERS Flash layers, VRAM capped at 24 GiB"
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
    timeout "$(gpu_tmo 270)" python3 packages/vllm-dsv41/benches/bench_prefill.py --layers "$LAYERS" --vram-gib 24 \
        --json "$OUT/bench_prefill.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_prefill.log"
    r=${PIPESTATUS[0]}; log "bench rc=$r"; rc=$((rc || r))
fi
log "done rc=$rc"
exit $rc
