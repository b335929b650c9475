#!/bin/bash
# Build and install the native cpu-tier where there is no network (the lent device machine): nanobind and
# scikit-build-core come from the wheels in .whl (carry=[".whl"]; see the package README). Run from anywhere:
#   bash packages/cpu-tier/scripts/build_native.sh LOG [--target DIR] [--emu ON|OFF]
# Installs into the interpreter's site-packages, or into DIR (pip --target); --emu OFF skips the test-only emulated
# AVX-512 module (default ON). Prints the build time; on failure the log's tail, and exits 1.
set -uo pipefail
cd "$(dirname "$0")/../../.."
log=${1:?usage: build_native.sh LOG [--target DIR] [--emu ON|OFF]}
shift
target=()
emu=ON
while [ $# -gt 0 ]; do
  case $1 in
    --target) target=(--target "$2"); shift 2 ;;
    --emu) emu=$2; shift 2 ;;
    *) echo "build_native.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ctbuildenv \
  .whl/nanobind-*.whl .whl/scikit_build_core-*.whl || exit 1
t0=$(date +%s)
PYTHONPATH=/tmp/ctbuildenv CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install --no-index --no-deps \
  --no-build-isolation --no-compile "${target[@]}" --config-settings=cmake.define.CPU_TIER_WITH_AVX512_EMULATION="$emu" \
  --config-settings=build-dir=/tmp/ctbuild packages/cpu-tier > "$log" 2>&1 || { tail -50 "$log"; exit 1; }
echo "cpu-tier built in $(( $(date +%s) - t0 )) s"
