# Source on the device machine after the gpu-vllm kit staged vLLM and the project wheels (and, optionally,
# gpu_stage_exl3.sh put exllamav3 in /tmp): the kit's environment, then exllamav3 behind the kit's site so the
# kit's pydantic wins.
source /tmp/gpuvllm/env.sh
if [ -d /tmp/exl3site ]; then
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/exl3pre:/tmp/exl3site"
fi
export PYTHONUNBUFFERED=1
