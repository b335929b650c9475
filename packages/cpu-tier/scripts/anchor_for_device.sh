#!/usr/bin/env bash
# exllamav3's CPU kernel (the exl3-cpu-anchor tool's bench_a) for the lent device machine, built here: the device has
# no network and no copy of ../shared. The kernel object is built by the tool as exllamav3 builds it (its tier chosen
# at run time); only the timing driver is relinked for a portable x86-64-v3 target instead of this CPU's -march=native.
# Usage, from the workspace root:  bash packages/cpu-tier/scripts/anchor_for_device.sh [DEST]   (default .anchor)
# Then carry DEST in the device call and pass --anchor DEST/bench_a to the bench (see the package README, H200 host).
set -euo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
tool="$root/../shared/tools/exl3-cpu-anchor"
dest=${1:-.anchor}
build=${ANCHOR_BUILD:-/tmp/exl3-cpu-anchor}
[ -f "$tool/build.sh" ] || { echo "anchor_for_device: no exl3-cpu-anchor tool at $tool" >&2; exit 2; }
[ -f "$build/moe_mul1.o" ] || bash "$tool/build.sh" "$build"   # ~4.5 min on 2 cores, needs PyPI
cpu=$(dirname "$(find "$build/src" -name moe_mul1.cpp | head -1)")
mkdir -p "$dest"
g++ -std=c++17 -O3 -march=x86-64-v3 -pthread -I "$tool/stub" -I "$cpu" "$tool/bench.cpp" "$build/moe_mul1.o" \
    -o "$dest/bench_a"
grep -qx '/.anchor/' "$root/.git/info/exclude" 2>/dev/null || [ "$dest" != .anchor ] \
    || echo '/.anchor/' >> "$root/.git/info/exclude"
echo "built $dest/bench_a (driver x86-64-v3; exllamav3's kernel picks its tier at run time)"
