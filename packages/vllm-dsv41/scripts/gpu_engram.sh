#!/usr/bin/env bash
# vllm-dsv41's Engram tables served from the pack's files (vllm_dsv41.engram) on the device machine. Needs the
# gpu-vllm kit staged (with the project wheels). Logs and JSON under $OUT.
#   STEPS="pack tests fidelity bench rss" bash packages/vllm-dsv41/scripts/gpu_engram.sh
# Steps (in this order, each optional):
#   pack      synthesize tiny-v41 and build its pack in /tmp/dsv41 (skipped when it is there already)
#   tests     pytest of tests/test_vllm_dsv41_engram_gpu.py: the rows served == upstream's pinned-table lookup bit
#             for bit (worker, inline, back to back while the GPU lags, under breakable CUDA graphs), and the served
#             logits vs the all-in-VRAM oracle (two fidelity runs, 512 positions)
#   fidelity  the full-size comparison: the all-in-VRAM oracle with upstream's Engram (tables read by vLLM's loader,
#             in VRAM) saved, then the served path (CPU expert tier, Engram rows from the pack's files, PIECEWISE
#             graphs, 24 GiB VRAM cap) against it: top-1 >= 0.999, KL mean <= 1e-4 (2048 positions)
#   bench     benches/bench_engram.py: gather per decode step cold / warm vs the Flash MoE layer 0 budget, prefill
#             rows/s vs the disk's random-read ceiling (16 GiB table file + a 5.1 GB Flash layer under /tmp/dsv41)
#   rss       scripts/engram_rss.py: host RSS (anon / file) while serving Flash-size sparse tables and a dense file
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/dsv41-out}
mkdir -p "$OUT"
source packages/vllm-dsv41/scripts/gpu_env.sh
export VLLM_USE_BREAKABLE_CUDAGRAPH=1  # the served setting for V4.1 (vllm_env_for_pack); the Engram hooks are eager breaks
STEPS=${STEPS:-"pack tests fidelity bench rss"}
PACK=/tmp/dsv41/tiny-v41
rc=0
step() {  # asked for, and at least 30 s of the call left (gpu_env.sh)
    case " $STEPS " in *" $1 "*) ;; *) return 1;; esac
    gpu_time_ok 30 || { log "$1: SKIPPED, $(gpu_left) s left of the call"; rc=1; return 1; }
}
log() { echo "[gpu_engram $(date +%T)] $*" | tee -a "$OUT/engram_steps.log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/engram_steps.log"
df -h /tmp | tail -1 | tee -a "$OUT/engram_steps.log"
if step pack && [ ! -f "$PACK/config.json" ]; then
    log "pack: synth + build"
    python3 - <<'PY' 2>&1 | tee "$OUT/engram_pack.log"
import time
from pathlib import Path
from pack_tools import build_pack, verify_pack
from pack_tools.origin import ENGRAM, EXL3
from pack_tools.presets.tiny_v41 import synth_tiny_v41
t = time.time(); root = Path("/tmp/dsv41"); synth_tiny_v41(root / "in")
build_pack(root / "in" / EXL3.dirname, root / "in" / ENGRAM.dirname, root / "tiny-v41", jobs=1, force=True)
assert verify_pack(root / "tiny-v41") == []
print(f"tiny-v41 pack built and verified in {time.time() - t:.1f} s")
PY
    [ "${PIPESTATUS[0]}" = 0 ] || { log "pack FAILED"; exit 1; }
fi
if step tests; then
    log "tests"
    # --timeout per test and short tracebacks: run 3 lost every failure's reason when the call's limit killed the
    # last test (the served fidelity, ~4 min cold) before pytest's summary; the kernel tests go first, one by one
    timeout "$(gpu_tmo 200)" python3 -m pytest packages/vllm-dsv41/tests/test_vllm_dsv41_engram_gpu.py -m gpu -v -p no:cacheprovider \
        -W ignore::DeprecationWarning --timeout 120 --tb=short -k "not served_logits" 2>&1 | tee "$OUT/engram_pytest_gpu.log" | tail -40
    r=${PIPESTATUS[0]}; log "tests (rows) rc=$r"; rc=$((rc || r))
    if [ "${TESTS_SERVED:-1}" = 1 ]; then  # TESTS_SERVED=0: the row tests only
        timeout "$(gpu_tmo 560)" python3 -m pytest packages/vllm-dsv41/tests/test_vllm_dsv41_engram_gpu.py -m gpu -v -p no:cacheprovider \
            -W ignore::DeprecationWarning --tb=short -k "served_logits" 2>&1 | tee "$OUT/engram_pytest_served_gpu.log" | tail -25
        r=${PIPESTATUS[0]}; log "tests (served) rc=$r"; rc=$((rc || r))
    fi
fi
if step fidelity; then
    log "fidelity: oracle (all-in-vram, upstream Engram)"
    timeout "$(gpu_tmo 560)" python3 -m vllm_dsv41.fidelity "$PACK" --against all-in-vram --engram upstream --gpu-memory-gib 24 \
        --save-reference "$OUT/engram_oracle.npz" > "$OUT/engram_fidelity_oracle.log" 2>&1
    r=$?; grep -v "INFO\|DEBUG" "$OUT/engram_fidelity_oracle.log" | tail -5; log "oracle rc=$r"; rc=$((rc || r))
    if [ "$r" = 0 ]; then
        log "fidelity: served (cpu tier, Engram from the pack's files) vs the oracle"
        timeout "$(gpu_tmo 560)" python3 -m vllm_dsv41.fidelity "$PACK" --runtime cpu --engram mmap --gpu-memory-gib 24 \
            --cpu-threads 8 --reference "$OUT/engram_oracle.npz" --json "$OUT/engram_fidelity.json" \
            --noise-floor --min-top1 0.999 --max-kl-mean 1e-4 > "$OUT/engram_fidelity.log" 2>&1
        r=$?; grep -v "INFO\|DEBUG" "$OUT/engram_fidelity.log" | tail -12
        grep -m2 "served from the pack's files" "$OUT/engram_fidelity.log"
        log "served rc=$r"; rc=$((rc || r))
    fi
fi
if step bench; then
    log "bench"
    timeout "$(gpu_tmo 590)" python3 packages/vllm-dsv41/benches/bench_engram.py --json "$OUT/engram_bench.json" \
        2>&1 | tee "$OUT/engram_bench.log"
    r=${PIPESTATUS[0]}; log "bench rc=$r"; rc=$((rc || r))
fi
if step rss; then
    log "rss"
    timeout "$(gpu_tmo 580)" python3 packages/vllm-dsv41/scripts/engram_rss.py --dense-gib 8 --steps 600 --every 100 --threads 64 \
        --json "$OUT/engram_rss.json" 2>&1 | tee "$OUT/engram_rss.log"
    r=${PIPESTATUS[0]}; log "rss rc=$r"; rc=$((rc || r))
fi
log "done rc=$rc"
exit $rc
