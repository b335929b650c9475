#!/usr/bin/env bash
# vllm-dsv41 on the device machine: the V4.1 EXL3 path end to end. Needs the gpu-vllm kit staged (with the project
# wheels) and, for the dense-kernel comparison, gpu_stage_exl3.sh. Logs under $OUT.
#   STEPS="pack tests fidelity" bash packages/vllm-dsv41/scripts/gpu_run.sh
# Steps (in this order, each optional):
#   pack      synthesize tiny-v41 and build its pack in /tmp/dsv41 (pack-tools)
#   tests     pytest -m gpu of vllm-dsv41, but the Engram gpu tests (gpu_engram.sh runs them); PYTEST_ARGS: more
#             arguments (split at spaces), PYTEST_K: a -k expression (may hold spaces)
#   fidelity  python -m vllm_dsv41.fidelity: cpu vs all-in-vram, PIECEWISE CUDA graphs, VRAM capped at 24 GiB (the CPU
#             tier's default precision: "auto", fast on this bf16 model)
#   exact     the same with the CPU tier's exact precision
#   eager     the same without CUDA graphs (greedy tokens compared with the PIECEWISE run)
#   tiered    fidelity of the tiered runtime (VRAM cache of ~1/3 of the experts; hit kernel auto with misses split
#             auto, then the Triton hit kernel with every miss over PCIe) vs all-in-vram, PIECEWISE graphs, VRAM
#             capped at 24 GiB; the first run's routing trace under $OUT
#   tbench    benches/bench_tiered.py: decode through the tiered runtime at Flash layer sizes (TB_LAYERS real-size
#             layers synthesized in /tmp, default 2) vs the roofline measured in the same run
#   host      benches/bench_host_overhead.py --device cuda: the tiered runtime's own host time and launches per MoE
#             layer call per decode path (no-op hit kernel, instant CPU tier; 40 small Flash-shaped layers);
#             HOST_ARGS adds arguments (--tier real: the CPU tier computes its jobs), HOST_TAG names the outputs
#   bench     benches/bench_dense_exl3.py (exllamav3 vs ours, every V4.1 dense shape)
#   serve     the server on the pack, driven by the openai client (scripts/gpu_serve_check.py)
#   flash     load time and RSS of a Flash-shaped pack with real-size layers (scripts/gpu_flash_load.py)
#   flashpack build + verify the flash-v41 pack (DEC_LAYERS real-size Flash layers, default 4: ~21 GB) in /tmp/dsv41/served
#             (benches/bench_served_decode.py --build-only; reused by later calls of the same lease)
#   ffidelity fidelity of the tiered runtime (default settings) vs all-in-vram on that pack (after flashpack, in this
#             call or an earlier one of the lease): the oracle dequantizes each routed expert per call on the GPU
#             (a real-size layer is 54 GB of fp32); VRAM capped at 24 GiB, PIECEWISE, --noise-floor;
#             FF_POSITIONS scored positions (default 512), FF_ARGS: more arguments (split at spaces), e.g.
#             '--tiered {"cache_gib":4}'
#   decode    benches/bench_served_decode.py on that pack: served decode tok/s at 1/2/4 streams for the runtimes
#             none / tiered (misses cpu, auto, pcie) / cpu vs the roofline of the same run; VRAM capped at 24 GiB,
#             PIECEWISE; DEC_RUNTIMES picks the cases (none first), DEC_TAG names the outputs, DEC_THREADS the CPU tier's threads (8); traces under $OUT;
#             DEC_ARGS: more arguments (split at spaces), e.g. "--hit-kernel triton";
#             DEC_PROFILE='tiered:auto:1' profiles one generate of that case and stream count (torch.profiler)
#   sprefill  benches/bench_served_prefill.py on that pack (PF_PROFILE=100: profile the tiered 100-token prompt):
#             served prompt tok/s at PF_PROMPTS lengths (default
#             2048,8192,16384) with PF_CHUNK-token chunks (default 8192), experts off vs the tiered runtime's staged
#             prefill, against the roofline of the same runs (streamed bytes / the measured copy rate + non-expert time);
#             PF_ARGS: more arguments (split at spaces), e.g. '--tiered {"prefill_ring_slots":24}'; PF_TAG names the outputs
#   savejit   tar the JIT caches (TileLang, Triton, vLLM/DeepGEMM) into $OUT/jitcache.tgz; a later machine restores
#             them from .jitcache/jitcache.tgz when that folder is carried (saves the cold compile, ~2-3 min)
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/dsv41-out}
mkdir -p "$OUT"
source packages/vllm-dsv41/scripts/gpu_env.sh
STEPS=${STEPS:-"pack tests fidelity"}
PACK=/tmp/dsv41/tiny-v41
rc=0
log() { echo "[gpu_run $(date +%T)] $*" | tee -a "$OUT/steps.log"; }
step() {  # asked for, and at least 30 s of the call left (gpu_env.sh)
    case " $STEPS " in *" $1 "*) ;; *) return 1;; esac
    gpu_time_ok 30 || { log "$1: SKIPPED, $(gpu_left) s left of the call"; rc=1; return 1; }
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/steps.log"
if [ -f .jitcache/jitcache.tgz ] && [ ! -f /tmp/dsv41-jit-restored ]; then
    tar xzf .jitcache/jitcache.tgz -C "$HOME" && touch /tmp/dsv41-jit-restored && log "JIT caches restored"
fi
needs_pack() { [ ! -f "$PACK/config.json" ] && case " $STEPS " in *" fidelity "*|*" exact "*|*" eager "*|*" tiered "*|*" serve "*) ;; *) false;; esac; }
if step pack || needs_pack; then  # (a later call of the lease reuses the pack; a fresh machine builds it again)
    log "pack: synth + build"
    python3 - <<'PY' 2>&1 | tee "$OUT/pack.log"
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
    # the Engram gpu tests (two served fidelity runs) belong to gpu_engram.sh's own call; PYTEST_ARGS adds e.g. -k
    # shellcheck disable=SC2086  # PYTEST_ARGS is a list of arguments
    timeout "$(gpu_tmo 540)" python3 -m pytest packages/vllm-dsv41/tests -m gpu -q -p no:cacheprovider -W ignore::DeprecationWarning \
        --ignore=packages/vllm-dsv41/tests/test_vllm_dsv41_engram_gpu.py ${PYTEST_ARGS:-} ${PYTEST_K:+-k "$PYTEST_K"} \
        2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
    r=${PIPESTATUS[0]}; log "tests rc=$r"; rc=$((rc || r))
fi
fid() {  # name, extra args; FID_PACK: another pack than $PACK
    local name=$1; shift
    log "fidelity $name"
    rm -f "/tmp/dsv41-results/fidelity_$name.json"
    timeout "$(gpu_tmo 560)" python3 -m vllm_dsv41.fidelity "${FID_PACK:-$PACK}" --runtime cpu --against all-in-vram --gpu-memory-gib 24 \
        --cpu-threads 8 --json "$OUT/fidelity_$name.json" --min-top1 0.999 --max-kl-mean 1e-4 --noise-floor "$@" \
        > "$OUT/fidelity_$name.log" 2>&1
    local r=$?
    mkdir -p /tmp/dsv41-results && cp -f "$OUT/fidelity_$name.json" /tmp/dsv41-results/ 2>/dev/null
    grep -v "INFO\|DEBUG" "$OUT/fidelity_$name.log" | tail -30
    log "fidelity $name rc=$r"; rc=$((rc || r))
}
step fidelity && fid piecewise
step exact && fid exact --precision exact
step eager && fid eager --eager
# PIECEWISE vs eager greedy tokens, also when the two ran in different calls of the lease (/tmp/dsv41-results)
if step eager && [ -f /tmp/dsv41-results/fidelity_piecewise.json ] && [ -f /tmp/dsv41-results/fidelity_eager.json ]; then
    python3 - /tmp/dsv41-results <<'PY' 2>&1 | tee -a "$OUT/steps.log"
import json, sys
a = json.load(open(f"{sys.argv[1]}/fidelity_piecewise.json")); b = json.load(open(f"{sys.argv[1]}/fidelity_eager.json"))
same = a["greedy_runtime"] == b["greedy_runtime"]
print(f"greedy tokens, cpu runtime, PIECEWISE graphs vs eager: {'IDENTICAL' if same else 'DIFFER'}")
PY
fi
if step tiered; then
    fid tiered --runtime tiered --tiered "{\"cache_gib\": 0.006, \"replan_every\": 4, \"trace_path\": \"$OUT/trace_tiered.npz\"}"
    fid tiered_pcie_triton --runtime tiered --tiered '{"cache_gib": 0.006, "replan_every": 4, "split": "pcie", "hit_kernel": "triton"}'
fi
if step tbench; then
    log "tbench"
    # shellcheck disable=SC2086  # TB_ARGS is a list of arguments (e.g. --pcie-read staged --hit-kernel triton)
    timeout "$(gpu_tmo 560)" python3 packages/vllm-dsv41/benches/bench_tiered.py --layers "${TB_LAYERS:-2}" --root /tmp/dsv41/flash \
        --streams 1,2,4 --splits cpu,auto,pcie --cpu-threads 8 --warmup 48 --steps 48 --json "$OUT/bench_tiered.json" ${TB_ARGS:-} \
        2>&1 | tee "$OUT/bench_tiered.log" | grep -v "INFO\|DEBUG" | tail -20
    r=${PIPESTATUS[0]}; log "tbench rc=$r"; rc=$((rc || r))
fi
if step host; then
    log "host"
    # shellcheck disable=SC2086  # HOST_ARGS is a list of arguments (e.g. the real CPU tier at Flash's sizes:
    # --layers 3 --hidden 4096 --intermediate 2048 --paths split-cpu --tier real; HOST_TAG names the outputs)
    timeout "$(gpu_tmo 300)" python3 packages/vllm-dsv41/benches/bench_host_overhead.py --device cuda --rounds 3 --steps 50 \
        --json "$OUT/bench_host_overhead${HOST_TAG:-}.json" ${HOST_ARGS:-} 2>&1 | tee "$OUT/bench_host_overhead${HOST_TAG:-}.log" \
        | grep -v "INFO\|DEBUG" | tail -24
    r=${PIPESTATUS[0]}; log "host rc=$r"; rc=$((rc || r))
fi
if step bench; then
    log "bench"
    timeout "$(gpu_tmo 500)" python3 packages/vllm-dsv41/benches/bench_dense_exl3.py --json "$OUT/bench_dense.json" \
        2>&1 | tee "$OUT/bench_dense.log"
    r=${PIPESTATUS[0]}; log "bench rc=$r"; rc=$((rc || r))
fi
if step serve; then
    log "serve"
    timeout "$(gpu_tmo 560)" python3 packages/vllm-dsv41/scripts/gpu_serve_check.py "$PACK" "$OUT" 2>&1 | tee "$OUT/serve_check.log" | tail -30
    r=${PIPESTATUS[0]}; log "serve rc=$r"; rc=$((rc || r))
fi
if step flash; then
    log "flash"
    timeout "$(gpu_tmo 560)" python3 packages/vllm-dsv41/scripts/gpu_flash_load.py "$OUT" 2>&1 | tee "$OUT/flash_load.log" | tail -30
    r=${PIPESTATUS[0]}; log "flash rc=$r"; rc=$((rc || r))
fi
if step flashpack; then
    log "flashpack"
    timeout "$(gpu_tmo 560)" python3 packages/vllm-dsv41/benches/bench_served_decode.py --build-only --layers "${DEC_LAYERS:-4}" \
        --root /tmp/dsv41/served 2>&1 | tee "$OUT/flashpack.log" | grep -v "it/s\]" | tail -8
    r=${PIPESTATUS[0]}; log "flashpack rc=$r"; rc=$((rc || r))
fi
if step ffidelity; then
    FLASHPACK=/tmp/dsv41/served/flash-v41-${DEC_LAYERS:-4}
    if [ -f "$FLASHPACK/config.json" ]; then
        # shellcheck disable=SC2086  # FF_ARGS is a list of arguments
        FID_PACK=$FLASHPACK fid flash --runtime tiered --positions "${FF_POSITIONS:-512}" --length 256 \
            --greedy-prompts 2 --greedy-tokens 16 ${FF_ARGS:-}
    else
        log "ffidelity: no pack at $FLASHPACK: run STEPS=flashpack first (DEC_LAYERS=${DEC_LAYERS:-4})"; rc=1
    fi
fi
if step decode; then
    log "decode"
    mkdir -p "$OUT/decode${DEC_TAG:-}"
    # shellcheck disable=SC2086  # DEC_ARGS is a list of arguments
    timeout "$(gpu_tmo 560)" python3 packages/vllm-dsv41/benches/bench_served_decode.py --layers "${DEC_LAYERS:-4}" --root /tmp/dsv41/served \
        --runtimes "${DEC_RUNTIMES:-none,tiered:auto,tiered:cpu,tiered:pcie,cpu}" --streams 1,2,4 --runs 3 --cpu-threads "${DEC_THREADS:-8}" \
        --time-budget-s "${DEC_BUDGET:-430}" --profile "${DEC_PROFILE:-}" --json "$OUT/decode${DEC_TAG:-}/bench_served_decode.json" \
        ${DEC_ARGS:-} 2>&1 | tee "$OUT/decode${DEC_TAG:-}/bench_served_decode.log" | grep -v "INFO\|DEBUG\|WARNING" | tail -40
    r=${PIPESTATUS[0]}; log "decode rc=$r"; rc=$((rc || r))
fi
if step sprefill; then
    log "sprefill"
    timeout "$(gpu_tmo 560)" python3 packages/vllm-dsv41/benches/bench_served_prefill.py --layers "${DEC_LAYERS:-4}" \
        --root /tmp/dsv41/served --prompts "${PF_PROMPTS:-2048,8192,16384}" --chunk "${PF_CHUNK:-8192}" --runs 3 \
        --cpu-threads 8 --time-budget-s 400 --profile "${PF_PROFILE:-}" --json "$OUT/bench_served_prefill${PF_TAG:-}.json" \
        ${PF_ARGS:-} 2>&1 | tee "$OUT/bench_served_prefill${PF_TAG:-}.log" | grep -v "INFO\|DEBUG\|WARNING" | tail -20
    r=${PIPESTATUS[0]}; log "sprefill rc=$r"; rc=$((rc || r))
fi
if step savejit; then
    (cd "$HOME" && tar czf "$OUT/jitcache.tgz" $(ls -d .cache/vllm .triton .tilelang 2>/dev/null))
    log "jit caches: $(du -sh "$OUT/jitcache.tgz" | cut -f1)"
fi
log "done rc=$rc"
exit $rc
