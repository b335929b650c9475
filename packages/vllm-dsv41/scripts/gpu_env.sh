# Source on the device machine after the gpu-vllm kit staged vLLM and the project wheels (and, optionally,
# gpu_stage_exl3.sh put exllamav3 in /tmp): the kit's environment, then exllamav3 behind the kit's site so the
# kit's pydantic wins.
source /tmp/gpuvllm/env.sh
if [ -d /tmp/exl3site ]; then
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/exl3pre:/tmp/exl3site"
fi
export PYTHONUNBUFFERED=1
# The working tree's pure-Python members first, so a device run measures the code it was sent with even when the
# staged project wheels are older (their dist-info still registers the plugin's entry point). The native members
# (cpu-tier, engram-mmap) come from their wheels only: rebuild those when their C++ changed.
_tree="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
for _p in vllm-dsv41 dma-prefill expert-cache pack-tools; do
    export PYTHONPATH="$_tree/packages/$_p/src${PYTHONPATH:+:$PYTHONPATH}"
done
unset _tree _p
