"""Streaming a chat reply, token by token, with sampling and a fixed seed.

python examples/chat_stream.py engines-out/default "Tell me about the Moon."
"""

import sys

from runner import LLM, SamplingParams

llm = LLM(sys.argv[1] if len(sys.argv) > 1 else "engines-out/default")
question = sys.argv[2] if len(sys.argv) > 2 else "Tell me about the Moon."
prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}])
for piece in llm.stream(prompt, SamplingParams(max_tokens=128, temperature=0.7, top_p=0.9, seed=0)):
    print(piece, end="", flush=True)
print()
