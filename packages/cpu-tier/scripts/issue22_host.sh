#!/usr/bin/env bash
# Every number issue 22 asks for on this host's AVX2 path, in one run (~8 min on 2 cores once the anchor is built):
#   1. m = 1 fast against exllamav3's own CPU kernel (the anchor), interleaved rounds, + the exact case (its ratio,
#      over the same rounds);
#   2. m = 1..8 fast jobs (tokens per expert; issue 22: m = 2..8 <= 1.3x of m = 1 per expert), each with the exact
#      job at the same m, round by round (exact within 2x of fast at every m);
#   3. the band kernels alone (scripts/avx2_kernel_time.cpp, thread CPU time): fast at m = 1, 2, 3, 4, 8 and exact at
#      m = 1..3,
#      interleaved rounds.
# Usage, from the workspace root, with cpu-tier installed (uv sync):
#   bash packages/cpu-tier/scripts/issue22_host.sh [OUT_PREFIX]
# OUT_PREFIX defaults to packages/cpu-tier/results/devbox_f<cpu family>m<model>_issue22; writes OUT_PREFIX.txt and
# OUT_PREFIX_*.json. Env: ANCHOR (default /tmp/exl3-cpu-anchor/bench_a, built with the shared tool when absent),
# ROUNDS (5), PYTHON (uv run --no-sync python). Run it on a quiet machine (1-minute load average below 1): every row
# records the load average.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
cd "$root"
family=$(awk -F': ' '/^cpu family/{print $2; exit}' /proc/cpuinfo)
model=$(awk -F': ' '/^model[[:space:]]*:/{print $2; exit}' /proc/cpuinfo)
out=${1:-packages/cpu-tier/results/devbox_f${family}m${model}_issue22}
anchor=${ANCHOR:-/tmp/exl3-cpu-anchor/bench_a}
rounds=${ROUNDS:-5}
py=${PYTHON:-uv run --no-sync python}
if [ ! -x "$anchor" ]; then
    tool="$root/../shared/tools/exl3-cpu-anchor/build.sh"
    [ -f "$tool" ] || { echo "issue22_host: no anchor at $anchor and no build tool at $tool" >&2; exit 2; }
    echo "issue22_host: building the exllamav3 anchor (~4.5 min)" >&2
    bash "$tool" "$(dirname "$anchor")" >&2
fi
log() { tee -a "$out.txt"; }
: > "$out.txt"
{
    echo "# issue 22 on $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) (family $family, model $model),"\
         "$(nproc) CPUs, $(date -u +%FT%TZ), git $(git rev-parse --short HEAD)$(git diff --quiet || echo '+dirty')"
    echo "# load average: $(cut -d' ' -f1-3 /proc/loadavg)"
} | log
echo "## 1. m = 1 fast vs exllamav3 (interleaved), + exact" | log
$py -m cpu_tier.bench --isa avx2 --tokens 1 --cases fast,exact --rounds "$rounds" --iters 10 --anchor "$anchor" \
    --json "${out}_anchor.json" 2>&1 | log
echo "## 2. fast and exact jobs at m = 1..8" | log
$py -m cpu_tier.bench --isa avx2 --tokens 1,2,3,4,5,6,7,8 --cases fast,exact --iters 10 --json "${out}_tokens.json" 2>&1 | log
echo "## 3. band kernels alone (Gw/s; v0 = fast pair form at m tokens, v2 = exact at m = 1, 2, 3), $rounds rounds" | log
kt=$(mktemp /tmp/kt.XXXXXX)
g++ -O3 -mavx2 -mfma -mf16c -std=c++17 -DCPU_TIER_NS=avx2 -DCPU_TIER_ISA_AVX2 -Ipackages/cpu-tier/csrc \
    packages/cpu-tier/scripts/avx2_kernel_time.cpp -o "$kt"
for r in $(seq "$rounds"); do
    for m in 1 2 3 4 8; do "$kt" "$m" 0 2 | log; done
    for m in 1 2 3; do "$kt" "$m" 2 2 | log; done
done
rm -f "$kt"
echo "# load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)" | log
