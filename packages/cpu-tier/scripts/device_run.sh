#!/bin/bash
# cpu-tier on the lent device machine (16-core H200 host), in ONE call: build the native variants there
# (scalar/avx2/avx512, and the emulated avx512 one unless EMU=OFF), run the package's non-gpu tests (this exercises the real AVX-512 kernels), then the
# benchmark on one core and on all cores (TESTS=0 skips the tests). Logs go to $OUT.
#   run(command="bash packages/cpu-tier/scripts/device_run.sh", carry=[".whl"])
# .whl must hold nanobind and scikit-build-core wheels for CPython 3.12 (see the package README).
set -o pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/cpu_tier_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  echo "== host"; nproc; lscpu | grep -E "Model name|Model:|CPU family|Stepping|Socket|Core|Thread|L2|L3|NUMA node0|MHz|Hypervisor|Flags" | cut -c1-400
  echo "siblings of cpu0: $(cat /sys/devices/system/cpu/cpu0/topology/thread_siblings_list 2>/dev/null)"
  echo "transparent hugepages: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)"
  python3 -c "import sys, numpy; print(sys.version.split()[0], 'numpy', numpy.__version__)"
} 2>&1 | tee "$OUT/host.txt"
# port-throughput probe (standalone, PORT_PROBE=1): clock, per-instruction throughput, the kernels' op sequence
if [ "${PORT_PROBE:-0}" = 1 ]; then
  g++ -O2 -march=native -pthread packages/cpu-tier/scripts/port_probe.cpp -o /tmp/port_probe \
    && timeout 60 /tmp/port_probe 2>&1 | tee "$OUT/ports.txt"
fi
# core-sharing probe (standalone, SMT_PROBE=1): which vCPUs share a physical core's vector ports
if [ "${SMT_PROBE:-0}" = 1 ]; then
  g++ -O2 -march=native -pthread packages/cpu-tier/scripts/smt_probe.cpp -o /tmp/smt_probe \
    && timeout 60 /tmp/smt_probe 2>&1 | tee "$OUT/smt.txt"
fi
bash packages/cpu-tier/scripts/build_native.sh "$OUT/build.log" --emu "${EMU:-ON}" || exit 1
python3 -c "import cpu_tier; print('runnable', cpu_tier.runnable_isas(), 'selected', cpu_tier.selected_isa()); print({k: v for k, v in cpu_tier.cpu_features().items() if 'amx' in k})"
[ "${TESTS:-1}" = 1 ] && timeout 170 python3 -m pytest packages/cpu-tier/tests -m "not gpu" -q -p no:cacheprovider -x 2>&1 | tee "$OUT/tests.txt" | tail -15
timeout ${BENCH_TIMEOUT:-200} python3 -m cpu_tier.bench ${BENCH_ARGS:-} --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt"
