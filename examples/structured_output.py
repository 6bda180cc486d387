"""Answers held to a JSON schema, a choice or a regular expression (structured outputs, via xgrammar).

    builder build default --out engines-out/default
    python examples/structured_output.py engines-out/default

The same through the server: `response_format` ({"type": "json_schema", "json_schema": {"schema": ...}}) or vLLM's
guided_json / guided_choice / guided_regex in the request body.
"""

import json
import sys

from runner import LLM, SamplingParams, StructuredOutputs

llm = LLM(sys.argv[1] if len(sys.argv) > 1 else "engines-out/default")
schema = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "enum": ["France", "Italy", "Spain"]},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}
asks = [
    ("What is the capital of France? Answer in JSON.", StructuredOutputs(json=schema)),
    ("Is the sea salty? Answer yes or no.", StructuredOutputs(choice=["yes", "no"])),
    ("Give me a time of day.", StructuredOutputs(regex=r"([01][0-9]|2[0-3]):[0-5][0-9]")),
]
for question, structured in asks:
    answer = llm.chat(
        [{"role": "user", "content": question}],
        SamplingParams(max_tokens=64, temperature=0.0, structured_outputs=structured),
    )[0]
    print(f"{question}\n  -> {answer.text!r} ({answer.finish_reason})")
    if structured.json is not None and answer.finish_reason == "stop":
        print(f"  parsed: {json.loads(answer.text)}")
