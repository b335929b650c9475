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
# the AVX-512 band kernels alone (standalone, KT512=1; scripts/avx512_kernel_time.cpp, thread CPU time, one pinned
# vCPU): fast (v0), the exact kernel (v2) and the generic float loop (v8) at m = 1, 2, 4, 3 rounds (~1 min)
if [ "${KT512:-0}" = 1 ]; then
  g++ -O3 -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mavx512vbmi \
      -mprefer-vector-width=512 -Wno-maybe-uninitialized -std=c++17 -DCPU_TIER_NS=avx512 -DCPU_TIER_ISA_AVX512 \
      -Ipackages/cpu-tier/csrc packages/cpu-tier/scripts/avx512_kernel_time.cpp -o /tmp/kt512 \
    && for r in 1 2 3; do for m in 1 2 4; do for v in 0 2 8; do taskset -c $(( $(nproc) - 1 )) /tmp/kt512 $m $v 2; done; done; done \
      2>&1 | tee "$OUT/kernel512.txt"
fi
bash packages/cpu-tier/scripts/build_native.sh "$OUT/build.log" --emu "${EMU:-ON}" || exit 1
python3 -c "import cpu_tier; print('runnable', cpu_tier.runnable_isas(), 'selected', cpu_tier.selected_isa()); print({k: v for k, v in cpu_tier.cpu_features().items() if 'amx' in k})"
[ "${TESTS:-1}" = 1 ] && timeout 170 python3 -m pytest packages/cpu-tier/tests -m "not gpu" -q -p no:cacheprovider -x 2>&1 | tee "$OUT/tests.txt" | tail -15
timeout ${BENCH_TIMEOUT:-200} python3 -m cpu_tier.bench ${BENCH_ARGS:-} --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt"
