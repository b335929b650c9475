# Source on the device machine after the gpu-vllm kit staged vLLM and the project wheels: the kit's environment,
# exllamav3 (staged here from a carried .exl3 the first time, gpu_stage_exl3.sh) behind the kit's site so the kit's
# pydantic wins, the working tree's pure-Python members first, and the call's housekeeping (gpu_tmo, gpu_time_ok,
# gpu_out_bundle: gpu_out_bundle.sh). Set OUT before sourcing.
export DSV41_CALL_T0=${DSV41_CALL_T0:-$(date +%s)}  # first, so staging exllamav3 below counts (see gpu_tmo)
source /tmp/gpuvllm/env.sh
_tree="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
if [ ! -f /tmp/exl3site/.staged ] && [ -d "$_tree/.exl3" ]; then
    bash "$_tree/packages/vllm-dsv41/scripts/gpu_stage_exl3.sh" || echo "gpu_env: staging exllamav3 FAILED" >&2
fi
if [ -d /tmp/exl3site ]; then
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/exl3pre:/tmp/exl3site"
fi
export PYTHONUNBUFFERED=1
# The working tree's pure-Python members first, so a device run measures the code it was sent with even when the
# staged project wheels are older (their dist-info still registers the plugin's entry point). The native members
# (cpu-tier, engram-mmap) come from their wheels only: rebuild those when their C++ changed. apps/server is no
# project wheel: it runs from the tree only (gpu_serve_check.py: python -m dsv41_server).
for _p in packages/vllm-dsv41 packages/dma-prefill packages/expert-cache packages/pack-tools apps/server; do
    export PYTHONPATH="$_tree/$_p/src${PYTHONPATH:+:$PYTHONPATH}"
done
unset _tree _p

# One device call runs at most 600 s, and the machine kills it there with everything unflushed: every step's timeout
# is cut to what is left of DSV41_CALL_S (default 585 s, counted from DSV41_CALL_T0: the first source of this file in
# the call; export DSV41_CALL_T0=$(date +%s) at the start of a call command that chains several scripts).
DSV41_CALL_S=${DSV41_CALL_S:-585}
gpu_left() { echo $((DSV41_CALL_S - ($(date +%s) - DSV41_CALL_T0))); }
gpu_tmo() {  # seconds: the step's own limit $1, cut to what is left of the call (at least 1: timeout 0 = none)
    local want=$1 left
    left=$(gpu_left)
    [ "$left" -lt "$want" ] && want=$left
    [ "$want" -lt 1 ] && want=1
    echo "$want"
}
gpu_time_ok() { [ "$(gpu_left)" -ge "${1:-30}" ]; }  # at least $1 s (default 30) left of the call

source "$(dirname "${BASH_SOURCE[0]}")/gpu_out_bundle.sh"
trap gpu_out_bundle EXIT
