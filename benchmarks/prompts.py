"""The benchmark prompts: a short chat turn (~40 tokens templated) and a long one (~650 tokens).

The long prompt's text is the CPython licence shipped with every CPython installation (read at run time, not
copied into this repository): real prose that nobody on this project wrote.
"""

from __future__ import annotations

import sys
from pathlib import Path

SHORT_QUESTION = "What is the capital of France?"


def license_text() -> str:
    for candidate in (Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "LICENSE.txt",
                      Path(sys.base_prefix) / "LICENSE.txt"):
        if candidate.is_file():
            return candidate.read_text()
    raise FileNotFoundError("no CPython LICENSE.txt found for the long benchmark prompt")


def chat_prompts(tokenizer, long_tokens: int = 650) -> dict[str, list[int]]:
    """Token ids of both prompts, chat-templated with the engine's own template."""
    short = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": SHORT_QUESTION}]))
    words = license_text().split()
    body = ""
    for size in range(50, len(words), 10):
        body = " ".join(words[:size])
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"Summarise this text:\n{body}"}])
        if len(tokenizer.encode(text)) >= long_tokens:
            break
    long = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": f"Summarise this text:\n{body}"}]))
    return {"short": short, "long": long}
