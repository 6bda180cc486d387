"""Batch generation with the Python API.

    builder build default --out engines-out/default
    python examples/generate.py engines-out/default
"""

import sys

from runner import LLM, SamplingParams

llm = LLM(sys.argv[1] if len(sys.argv) > 1 else "engines-out/default")
prompts = ["The three primary colours are", "A haiku about compilers:", "def fibonacci(n):"]
for output in llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0)):
    print(f"--- {output.prompt!r} ({len(output.token_ids)} tokens, {output.finish_reason})\n{output.text}\n")
