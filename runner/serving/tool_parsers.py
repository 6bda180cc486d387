"""Tool calls the model decides to make (OpenAI's `tool_choice: "auto"`), read from its answer in the syntax its
family's chat template teaches it, as vLLM's `--tool-call-parser` does:

- `hermes` (Hermes, Qwen2.5 and later, SmolLM3, ...): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call, possibly after some text (the message's content);
- `llama3_json` (Llama 3.1 / 3.2 / 3.3): the whole answer is `{"name": ..., "parameters": {...}}`, or several such
  objects separated by `;`, possibly after the `<|python_tag|>` token;
- `pythonic` (Llama 3.2 and 4 with their pythonic templates, and other small models): the whole answer is a Python
  list of calls with literal keyword arguments, `[get_weather(city="Paris"), now()]`.

An answer that is not well-formed in that syntax stays text: a parser never guesses. While streaming, text that
surely is content is sent as it comes; from where a call may begin it is held back, and the calls are sent whole
with the last chunk (their arguments are not streamed piece by piece, unlike a forced call's).
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field

from runner.core.engine import held_back


@dataclass(frozen=True)
class ParsedCalls:
    content_end: int  # the answer's text before the calls (all of it when there are none)
    calls: list[tuple[str, str]]  # (function name, arguments as a JSON string)


class HermesParser:
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> ParsedCalls:
        start = text.find(self.START)
        if start == -1:
            return ParsedCalls(len(text), [])
        calls = []
        for block in self._BLOCK.finditer(text, start):
            call = _call(block.group(1).strip(), "arguments")
            if call is None:
                return ParsedCalls(len(text), [])
            calls.append(call)
        return ParsedCalls(start, calls)

    def streamable(self, text: str) -> int:
        """How many leading characters are content whatever comes next."""
        start = text.find(self.START)
        return start if start != -1 else len(text) - held_back(text, [self.START])


class Llama3JsonParser:
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedCalls:
        body = text.strip()
        body = body[len(self.TAG) :].lstrip() if body.startswith(self.TAG) else body
        decoder, calls, position = json.JSONDecoder(), [], 0
        while body.startswith("{", position):
            try:
                value, position = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return ParsedCalls(len(text), [])
            call = _call(value, "parameters")
            if call is None:
                return ParsedCalls(len(text), [])
            calls.append(call)
            while position < len(body) and body[position] in "; \n\t":
                position += 1
        if not calls or position < len(body):  # not (only) calls: the answer is text
            return ParsedCalls(len(text), [])
        return ParsedCalls(0, calls)

    def streamable(self, text: str) -> int:
        """An answer that starts (or may start) with a call is held back whole; any other is content."""
        start = text.lstrip()
        if not start or start.startswith(("{", self.TAG)) or self.TAG.startswith(start):
            return 0
        return len(text)


class PythonicParser:
    name = "pythonic"

    def parse(self, text: str) -> ParsedCalls:
        try:
            tree = ast.parse(text.strip(), mode="eval").body
        except SyntaxError:
            return ParsedCalls(len(text), [])
        if not isinstance(tree, ast.List) or not tree.elts:
            return ParsedCalls(len(text), [])
        calls = []
        for call in tree.elts:
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
                return ParsedCalls(len(text), [])
            try:  # literal values only: the answer is read, never run
                arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}
            except ValueError:
                return ParsedCalls(len(text), [])
            if None in arguments:  # a **mapping
                return ParsedCalls(len(text), [])
            calls.append((call.func.id, json.dumps(arguments, ensure_ascii=False)))
        return ParsedCalls(0, calls)

    def streamable(self, text: str) -> int:
        """An answer that starts with "[" may be calls and is held back whole; any other is content."""
        start = text.lstrip()
        return 0 if not start or start.startswith("[") else len(text)


ToolCallParser = HermesParser | Llama3JsonParser | PythonicParser
PARSERS: dict[str, ToolCallParser] = {
    parser.name: parser for parser in (HermesParser(), Llama3JsonParser(), PythonicParser())
}


def _call(value, arguments_key: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of one call object (JSON text or parsed), None when it is not one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    return value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


@dataclass
class AutoToolStream:
    """One streamed chat response's state per completion: its text so far and how much of it was sent."""

    parser: ToolCallParser
    text: dict[str, str] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)
    text_started: set[str] = field(default_factory=set)  # completions whose first chunk (with the role) went out

    def push(self, request_id: str, delta: str) -> tuple[str, str]:
        """-> (the completion's text so far, its content not sent yet that may be sent now)."""
        text = self.text[request_id] = self.text.get(request_id, "") + delta
        sent = self.sent.get(request_id, 0)
        ready = max(self.parser.streamable(text), sent)
        self.sent[request_id] = ready
        return text, text[sent:ready]

    def rest(self, request_id: str, end: int) -> str:
        """Content up to `end` not sent yet (at the end of the completion)."""
        sent = self.sent.get(request_id, 0)
        self.sent[request_id] = max(end, sent)
        return self.text[request_id][sent:end]
