#!/usr/bin/env bash
# Device machine, in a call that carries .exl3 (see ../shared/tools/exllamav3-sm90/README.md): install
# exllamav3 1.6.5 and the extension prebuilt for the H200 into /tmp, so later calls import it in ~2 s (no carry).
# gpu_env.sh runs this itself when .exl3 is carried and /tmp/exl3site/.staged is missing.
set -euo pipefail
cd "$(dirname "$0")/../../.."
[ -d .exl3 ] || { echo "gpu_stage_exl3: carry .exl3"; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/exl3site .exl3/exllamav3-*.whl \
    .exl3/marisa_trie-*.whl .exl3/llguidance-*.whl
mkdir -p /tmp/exl3pre && xz -dc .exl3/exllamav3_ext.so.xz > /tmp/exl3pre/exllamav3_ext.so
touch /tmp/exl3site/.staged
echo "gpu_stage_exl3: exllamav3 staged in /tmp/exl3site, extension in /tmp/exl3pre"
