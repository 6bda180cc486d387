"""Batch generation with the Python API.

builder build default --out engines-out/default
python examples/generate.py engines-out/default
"""

import sys

from runner import LLM, SamplingParams

llm = LLM(sys.argv[1] if len(sys.argv) > 1 else "engines-out/default")
prompts = ["The three primary colours are", "A haiku about compilers:", "def fibonacci(n):"]
for output in llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0)):
    completion = output.outputs[0]  # vLLM's shape: n completions per prompt (output.text reads the only one)
    print(
        f"--- {output.prompt!r} ({len(completion.token_ids)} tokens, {completion.finish_reason})\n{completion.text}\n"
    )
