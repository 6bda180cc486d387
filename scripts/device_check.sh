#!/usr/bin/env bash
# The GPU check (scripts/device_check.py) on a lent GPU machine, from the repository root, with nothing but what
# that machine's image holds; under 8 minutes on an H100 (DEVICE_CHECK_SECONDS, default 470: a stage that would
# start later is recorded as skipped). Writes $OUT/device_check.json and $OUT/device_check.md.
# Arguments name stages to run (kernel, tiny, 1b; default all), to split the check over two calls.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OUT="${OUT:-$PWD/device_check_out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout "$(( ${DEVICE_CHECK_SECONDS:-470} + 60 ))" python3 scripts/device_check.py "$@" 2>&1 | tee "$OUT/device_check.log"
