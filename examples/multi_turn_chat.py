"""A conversation with prefix caching: every turn sends the whole conversation again (as chat clients do), and
only what is new since the last turn is computed.

    python examples/multi_turn_chat.py engines-out/default
"""

import sys

from runner import LLM, SamplingParams

llm = LLM(sys.argv[1] if len(sys.argv) > 1 else "engines-out/default", enable_prefix_caching=True)
messages = [{"role": "system", "content": "You are a concise assistant."}]
for question in ["What is the capital of France?", "What is it famous for?", "Name one museum there."]:
    messages.append({"role": "user", "content": question})
    reply = llm.chat(messages, SamplingParams(max_tokens=64, temperature=0.0))[0]
    messages.append({"role": "assistant", "content": reply.text})
    print(
        f"> {question}\n{reply.text}\n[{len(reply.prompt_token_ids)} prompt tokens, "
        f"{reply.num_cached_tokens} of them from the cache]\n"
    )
