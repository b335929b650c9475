#!/usr/bin/env bash
# vllm-dsv41 pipeline parallel on a 2-GPU device machine (issue 21), VRAM capped at 24 GiB per GPU. Needs the
# gpu-vllm kit staged (with the project wheels). Logs and JSON under $OUT.
#   STEPS="pack fidelity flash speed" bash packages/vllm-dsv41/scripts/gpu_pp.sh
# Steps (in this order, each optional):
#   pack      synthesize tiny-v41 and build its pack in /tmp/dsv41 (as gpu_run.sh does; skipped when it exists)
#   fidelity  tiny-v41 served with 2 pipeline stages vs 1 stage (python -m vllm_dsv41.fidelity: --save-reference at
#             PP=1, --reference at PP=2; top-1 >= 0.999, KL mean <= 1e-4): the cpu runtime, then the tiered one
#   flash     synthesize a Flash-shaped pack in /tmp/dsv41/flash-pp: V4.1-Flash's per-layer shapes (hidden 5120,
#             64 x 512 heads, expert 5120 x 2304 at 3 bpw, top-6) with FLASH_LAYERS layers (default 4) of
#             FLASH_EXPERTS routed experts (default 96: 1.27 GB a layer); skipped when it exists
#   speed     the Flash-shaped pack served at PP=1 and PP=2 (runtime RUNTIME, default tiered; PIECEWISE graphs):
#             prefill tok/s (PREFILL prompts of PREFILL_LEN tokens, default 8 x 1024, one token out) and decode
#             tok/s at 1, 2 and 4 concurrent streams (DECODE tokens each, default 64), REPS runs each (default 3),
#             min/median/max; then per row PP=2 / PP=1 and, for 2+
#             streams, PP=2 against the ideal 2x of a full two-stage pipeline
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/dsv41-out}
mkdir -p "$OUT"
source packages/vllm-dsv41/scripts/gpu_env.sh
STEPS=${STEPS:-"pack fidelity flash speed"}
PACK=/tmp/dsv41/tiny-v41
FLASH=/tmp/dsv41/flash-pp
RUNTIME=${RUNTIME:-tiered}
rc=0
step() { case " $STEPS " in *" $1 "*) return 0;; *) return 1;; esac; }
log() { echo "[gpu_pp $(date +%T)] $*" | tee -a "$OUT/steps.log"; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/steps.log"
nvidia-smi topo -m 2>&1 | tee "$OUT/topo.log" | head -5
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
[ "$gpus" -ge 2 ] || { log "needs 2 GPUs, found $gpus"; exit 1; }

synth() {  # out-dir, python expression of the TinyV41 dims
    python3 - "$1" "$2" <<'PY'
import dataclasses, sys, time
from pathlib import Path
from pack_tools import build_pack, verify_pack
from pack_tools.origin import ENGRAM, EXL3
from pack_tools.presets.tiny_v41 import FLASH, TinyV41, synth_tiny_v41
out = Path(sys.argv[1]); dims = eval(sys.argv[2], {"FLASH": FLASH, "TinyV41": TinyV41, "dataclasses": dataclasses})
t = time.time(); src = out.parent / (out.name + "-in")
synth_tiny_v41(src, dims=dims)
print(f"synth {out.name}: {time.time() - t:.0f} s ({dims})", flush=True)
build_pack(src / EXL3.dirname, src / ENGRAM.dirname, out, jobs=4, force=True)
assert verify_pack(out) == []
print(f"{out} built and verified in {time.time() - t:.0f} s", flush=True)
PY
}
if step pack && [ ! -f "$PACK/config.json" ]; then
    log "pack: tiny-v41"
    synth "$PACK" "TinyV41()" 2>&1 | tee "$OUT/pack.log"
    [ "${PIPESTATUS[0]}" = 0 ] || { log "pack FAILED"; exit 1; }
fi

fid_pair() {  # name, runtime, extra fidelity args (the runtime's settings)
    local name=$1 runtime=$2; shift 2
    local common=(--positions 1024 --length 256 --greedy-prompts 4 --greedy-tokens 32 --gpu-memory-gib 24
                  --cpu-threads 8)
    log "fidelity $name: PP=1 reference ($runtime)"
    timeout 560 python3 -m vllm_dsv41.fidelity "$PACK" --against "$runtime" "${common[@]}" "$@" \
        --save-reference "$OUT/pp1_$name.npz" > "$OUT/fidelity_pp1_$name.log" 2>&1
    local r=$?; tail -2 "$OUT/fidelity_pp1_$name.log"; log "fidelity $name PP=1 rc=$r"; rc=$((rc || r))
    [ "$r" = 0 ] || return
    log "fidelity $name: PP=2 vs the PP=1 reference"
    timeout 560 python3 -m vllm_dsv41.fidelity "$PACK" --runtime "$runtime" --reference "$OUT/pp1_$name.npz" \
        --pipeline-parallel-size 2 "${common[@]}" "$@" --json "$OUT/fidelity_pp2_$name.json" --min-top1 0.999 \
        --max-kl-mean 1e-4 > "$OUT/fidelity_pp2_$name.log" 2>&1
    r=$?
    grep "pipeline rank\|expert runtime" "$OUT/fidelity_pp2_$name.log" | sed 's/^.*\] //' | sort -u
    grep -v "INFO\|DEBUG\|WARNING" "$OUT/fidelity_pp2_$name.log" | tail -12
    log "fidelity $name PP=2 rc=$r"; rc=$((rc || r))
}
if step fidelity; then
    fid_pair cpu cpu
    fid_pair tiered tiered --tiered '{"cache_gib": 0.006, "replan_every": 4}'
fi

if step flash && [ ! -f "$FLASH/config.json" ]; then
    log "flash: synth a Flash-shaped pack (${FLASH_LAYERS:-4} layers x ${FLASH_EXPERTS:-96} experts)"
    dims="dataclasses.replace(FLASH, layers=${FLASH_LAYERS:-4}, experts=${FLASH_EXPERTS:-96}, mtp=1, mtp_experts=4,
          engram_layers=(1, 2), engram_vocab=100_000, kv_source_layers=(2, 3), index_source_layers=(2, 3),
          exl3_shards=8)"
    synth "$FLASH" "$dims" 2>&1 | tee "$OUT/flash_pack.log"
    r=${PIPESTATUS[0]}; log "flash pack rc=$r"; [ "$r" = 0 ] || exit 1
fi

if step speed; then
    cat > /tmp/dsv41_pp_speed.py <<'PY'
"""One serving configuration of the Flash-shaped pack: prefill and decode tok/s (min/median/max over REPS)."""
import json, os, statistics, sys, time
pack, pp, runtime, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
reps, prefill_n, decode_n = int(os.environ.get("REPS", 3)), int(os.environ.get("PREFILL", 8)), int(os.environ.get("DECODE", 64))
for k, v in __import__("vllm_dsv41").vllm_env_for_pack(pack).items():
    os.environ.setdefault(k, v)
def main():
    import torch
    from vllm import SamplingParams
    from vllm_dsv41.fidelity import build_llm
    t = time.time()
    llm = build_llm(pack, runtime=runtime, gpu_memory_gib=24, cpu_threads=int(os.environ.get("CPU_THREADS", 16)),
                    max_model_len=int(os.environ.get("MAX_MODEL_LEN", 4096)), pipeline_parallel_size=pp, extra={"max_num_seqs": 8})
    print(f"PP={pp} {runtime}: engine up in {time.time() - t:.0f} s", flush=True)
    vocab = len(llm.get_tokenizer())  # with the added (reserved filler) tokens
    def prompts(n, length, seed):
        import random
        r = random.Random(seed)
        return [{"prompt_token_ids": [r.randrange(300, vocab - 1) for _ in range(length)]} for _ in range(n)]
    def timed(ps, tokens):
        sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter(); llm.generate(ps, sp, use_tqdm=False); return time.perf_counter() - t0
    timed(prompts(2, 256, 0), 8)  # warm-up: graphs, caches
    rows = {}
    sec = [timed(prompts(prefill_n, int(os.environ.get("PREFILL_LEN", 1024)), 10 + i), 1) for i in range(reps)]
    rows["prefill"] = [prefill_n * int(os.environ.get("PREFILL_LEN", 1024)) / s for s in sec]
    for streams in (1, 2, 4):
        rates = []
        for i in range(reps):
            ps = prompts(streams, 64, 100 * streams + i)
            t_first = timed(ps, 1)
            t_all = timed(ps, 1 + decode_n)  # same prompts: the difference is decode_n steps per stream
            rates.append(streams * decode_n / max(t_all - t_first, 1e-9))
        rows[f"decode x{streams}"] = rates
    for k, v in rows.items():
        print(f"PP={pp} {runtime} {k:>10}: {min(v):9.1f} / {statistics.median(v):9.1f} / {max(v):9.1f} tok/s "
              "(min/median/max)", flush=True)
    json.dump({"pp": pp, "runtime": runtime, "rows": rows}, open(out, "w"), indent=1)
if __name__ == "__main__":
    main()
PY
    for pp in 1 2; do
        log "speed PP=$pp ($RUNTIME)"
        timeout 590 python3 /tmp/dsv41_pp_speed.py "$FLASH" "$pp" "$RUNTIME" "$OUT/speed_pp$pp.json" \
            > "$OUT/speed_pp$pp.log" 2>&1
        r=$?; grep "PP=$pp\|pipeline rank\|Error" "$OUT/speed_pp$pp.log" | grep -v "INFO" | tail -12
        log "speed PP=$pp rc=$r"; rc=$((rc || r))
    done
    python3 - "$OUT" <<'PY' 2>&1 | tee -a "$OUT/steps.log"
import json, statistics, sys
try:
    a, b = (json.load(open(f"{sys.argv[1]}/speed_pp{p}.json")) for p in (1, 2))
except OSError as e:
    sys.exit(f"no ratio: {e}")
print(f"{'case':>12} {'PP=1 tok/s':>11} {'PP=2 tok/s':>11} {'PP2/PP1':>8} {'vs ideal 2x':>11}   ({a['runtime']}, medians)")
for k in a["rows"]:
    x, y = statistics.median(a["rows"][k]), statistics.median(b["rows"][k])
    ideal = "" if k == "decode x1" else f"{y / (2 * x):11.2f}"
    print(f"{k:>12} {x:11.1f} {y:11.1f} {y / x:8.2f} {ideal}")
PY
fi
log "done rc=$rc"
exit $rc
