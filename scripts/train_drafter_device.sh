#!/usr/bin/env bash
# Distils ReDrafter heads for the default model on a lent GPU machine: `builder train-drafter` in PyTorch on CUDA
# (answers, scoring and training there), one head per entry of BLOCKS on the same answers. Writes each head, its log
# and the GPU's name to $OUT.
#   scripts/train_drafter_device.sh GGUF [PROMPTS]      (DEVICE, EPOCHS, BLOCKS, TRACES override the defaults below)
# The machine's image lacks only the gguf package (a carried wheel on PYTHONPATH), and a call carries at most 64 MiB,
# so the 94 MiB GGUF travels in two parts over two calls and is joined there first (docs/gpu.md).
# Time on an H200: the 32,768 answers ~200 s, an epoch of the 2-block head ~45 s, so the defaults (7 epochs, one
# head) fit one call of ~560 s. The 4-block head measured no better on validation and slower end to end: BLOCKS="2 4"
# trains it too. A head file is rewritten at each better epoch, so a call cut short keeps the best one so far.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OUT="${OUT:-$PWD/drafter_out}"
gguf=$1
prompts=${2:-32768}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true; } | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
common=(train-drafter "$gguf" --device "${DEVICE:-cuda}" --prompts "$prompts" --validation 40
        --traces "${TRACES:-/tmp/drafter-traces}" --shard-size 4096 --generate-batch 1024
        --batch-size 1024 --learning-rate 3e-3 --epochs "${EPOCHS:-7}")
# the first head's run answers every prompt (its traces stay for the next)
for blocks in ${BLOCKS:-2}; do
  python3 -m training.cli "${common[@]}" --blocks "$blocks" --out "$OUT/head_${blocks}blocks.safetensors" 2>&1 |
    tee "$OUT/head_${blocks}blocks.log"
done
