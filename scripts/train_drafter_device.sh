#!/usr/bin/env bash
# Distils ReDrafter heads for the default model on a lent GPU machine: `builder train-drafter` in PyTorch on CUDA
# (answers, scoring and training there), then the same data with a deeper head. Writes each head, its log and the
# GPU's name to $OUT.
#   scripts/train_drafter_device.sh GGUF [PROMPTS]      (DEVICE, EPOCHS, TRACES override the defaults below)
# The machine's image lacks only the gguf package (a carried wheel on PYTHONPATH), and a call carries at most 64 MiB,
# so the 94 MiB GGUF travels in two parts over two calls and is joined there first (docs/gpu.md).
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
        --batch-size 1024 --learning-rate 3e-3 --epochs "${EPOCHS:-4}")
# the first run answers every prompt (its traces stay for the second); each head is written as soon as it is trained
python3 -m training.cli "${common[@]}" --out "$OUT/head_2blocks.safetensors" 2>&1 | tee "$OUT/head_2blocks.log"
python3 -m training.cli "${common[@]}" --blocks 4 --out "$OUT/head_4blocks.safetensors" 2>&1 | tee "$OUT/head_4blocks.log"
