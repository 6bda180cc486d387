"""OpenAI's Responses API (`POST /v1/responses`) on the chat machinery: a request's input items become chat turns
for the engine's chat template, the answer becomes output items (a message, function calls), and a stream sends the
API's typed events (response.created ... response.completed). No HTTP here, nor engine: serving_responses.py
answers the routes with these.

The mapping:
- input: a string (one user turn) or a list of items: messages ({"role", "content"}; content a string or
  input_text / output_text parts), function_call items (the assistant's earlier calls) and function_call_output
  items (their results, tool turns); `instructions` become a system turn first and, as OpenAI has it, are not
  carried into a later response that names this one as `previous_response_id`;
- tools: function tools ({"type": "function", "name", "parameters"}) with the chat endpoint's rules: tool_choice
  "required" or a named function are structured outputs, "auto" needs the server's tool-call parser;
- text.format: text, json_object or json_schema (structured outputs, as response_format in chat);
- output: a message with one output_text part (its logprobs when `include` asks for
  "message.output_text.logprobs"), and / or function_call items; status "incomplete" with reason
  "max_output_tokens" when the answer was cut.

Stored responses (`store`, OpenAI's default true) live in a bounded store in the server's memory, the oldest
dropped first: enough for `previous_response_id` chains and `GET /v1/responses/{id}`, not a database.
"""

from __future__ import annotations

import copy
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from runner.serving.tool_calls import ForcedTools
from runner.serving.tool_parsers import AutoToolStream, ToolCallParser

LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the one `include` value this server has anything for
STORED_RESPONSES = 1024


class ResponsesError(ValueError):
    def __init__(self, message: str, param: str | None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


def chat_turns(input_items: str | list, instructions: str | None, earlier: list[dict]) -> tuple[list[dict], list[dict]]:
    """-> (the turns the chat template reads, the turns this request adds to the conversation): `earlier` is the
    stored conversation of `previous_response_id` (empty without one)."""
    items = [{"role": "user", "content": input_items}] if isinstance(input_items, str) else input_items
    if not items:
        raise ResponsesError("input is empty", "input")
    added: list[dict] = []
    for item in items:
        if not isinstance(item, dict):
            raise ResponsesError("each input item must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ("user", "system", "developer", "assistant"):
                raise ResponsesError(f"unknown message role {item.get('role')!r}", "input")
            added.append({"role": item["role"], "content": _text(item.get("content"))})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise ResponsesError("a function_call item needs a name and a call_id", "input")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments", "")},
            }
            if added and added[-1]["role"] == "assistant":  # the calls after an answer's text: one turn, as in chat
                added[-1].setdefault("tool_calls", []).append(call)
            else:
                added.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ResponsesError("a function_call_output item needs the call_id it answers", "input")
            output = item.get("output")
            added.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": output if isinstance(output, str) else _text(output),
                }
            )
        else:
            raise ResponsesError(
                f"input items of type {kind!r} are not supported (message, function_call, function_call_output)",
                "input",
            )
    system = [{"role": "system", "content": instructions}] if instructions else []
    return system + earlier + added, added


def input_items(input_items: str | list) -> list[dict]:
    """The request's input as the API lists it back (GET /v1/responses/{id}/input_items): items with ids, message
    content as parts (a string input is a user message with one input_text part). Read after chat_turns accepted
    them."""
    if isinstance(input_items, str):
        input_items = [{"role": "user", "content": input_items}]
    prefixes = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
    listed = []
    for item in input_items:
        kind = item.get("type", "message")
        listed.append({**item, "id": item.get("id") or new_id(prefixes[kind]), "type": kind})
        if kind == "message" and not isinstance(item.get("content"), list):
            part = "output_text" if item["role"] == "assistant" else "input_text"
            listed[-1]["content"] = [{"type": part, "text": item.get("content") or ""}]
    return listed


def _text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ResponsesError(
            "a message's content (a function_call_output's output) must be a string or a list of text parts", "input"
        )
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ResponsesError(f"unsupported content part {kind!r}: this model reads text only", "input")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def chat_tools(tools: list | None) -> list[dict] | None:
    """Responses' function tools ({"type": "function", "name", "parameters"}) in the chat API's nested shape."""
    if not tools:
        return None
    nested = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ResponsesError(
                f'only function tools ({{"type": "function", "name": ..., "parameters": ...}}) '
                f"are supported, not {kind!r}",
                "tools",
            )
        nested.append(
            {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool}}
        )
    return nested


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ResponsesError('tool_choice must be none, auto, required or {"type": "function", "name": ...}', "tool_choice")


def response_format(text: dict | None) -> dict | None:
    """`text` ({"format": ...}) as the chat API's response_format (None: plain text)."""
    if not text:
        return None
    if text.get("verbosity") not in (None, "medium"):
        raise ResponsesError("text.verbosity is not supported by this server", "text.verbosity")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if fmt.get("schema") is None:
            raise ResponsesError("text.format json_schema needs a schema", "text.format")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt["schema"]}}
    raise ResponsesError(f"text.format type {kind!r} is not one of text, json_object, json_schema", "text.format")


def output_turns(items: list[dict]) -> list[dict]:
    """A response's output items as the assistant turn a later response's chat template reads."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    calls = [
        {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in items
        if item["type"] == "function_call"
    ]
    return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponseOutput:
    """One response's output items, built as the answer comes; every change is also an event, numbered, for a
    stream. A response that is not streamed is the same builder fed its whole answer at once, so streamed and
    non-streamed responses hold the same items.

    `tools`: forced calls (a named function's arguments stream as they come; "required" calls are known at the end);
    `parser`: tool_choice "auto", the calls read from the model's own syntax at the end (the text before them is the
    message); neither: the answer is the message."""

    tools: ForcedTools | None = None
    parser: ToolCallParser | None = None
    items: list[dict] = field(default_factory=list)
    sequence: int = 0
    _open: dict | None = None  # the item being written, until its output_item.done
    _answer: str = ""  # a "required" answer, parsed at the end
    _logprobs: list[dict] = field(default_factory=list)  # of text held back, sent with the next text
    _auto: AutoToolStream | None = None

    def __post_init__(self) -> None:
        if self.parser is not None:
            self._auto = AutoToolStream(self.parser)
            self._auto.push("", "")  # (an answer with no text at all still has one)

    def event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def feed(self, delta: str, logprobs: list[dict]) -> list[dict]:
        """The answer's next text and its tokens' logprobs (API-shaped) -> the events they make."""
        if self.tools is not None and self.tools.name is not None:
            events = [] if self._open else self._start(_function_call(self.tools.name))
            if delta:
                self._open["arguments"] += delta
                events.append(self._arguments_delta(delta))
            return events
        self._logprobs += logprobs
        if self.tools is not None:
            self._answer += delta
            return []
        if self._auto is not None:
            delta = self._auto.push("", delta)[1]
        return self._say(delta)

    def _arguments_delta(self, delta: str) -> dict:
        """The event that adds `delta` to the open function call's arguments."""
        return self.event(
            "response.function_call_arguments.delta",
            item_id=self._open["id"],
            output_index=len(self.items) - 1,
            delta=delta,
        )

    def finish(self, answer: str, finish_reason: str | None) -> list[dict]:
        """The events that close the output, given the whole answer and why it ended."""
        status = "incomplete" if finish_reason == "length" else "completed"
        if self.tools is not None and self.tools.name is not None:
            return self._close(status) if self._open else []
        calls: list[tuple[str, str]] = []
        if self.tools is not None:
            forced = self.tools.tool_calls(self._answer) if finish_reason == "stop" else None
            if forced is None:  # cut short: not a call, the text itself
                events = self._say(self._answer)
            else:
                events, calls = [], [(c["function"]["name"], c["function"]["arguments"]) for c in forced]
        elif self._auto is not None:
            parsed = self.parser.parse(answer) if finish_reason == "stop" else None
            events = self._say(self._auto.rest("", len(answer) if parsed is None else parsed.content_end))
            calls = [] if parsed is None else parsed.calls
        else:
            events = []
        if self._open:
            events += self._close(status)
        for name, arguments in calls:
            events += self._start(_function_call(name))
            self._open["arguments"] = arguments
            events.append(self._arguments_delta(arguments))
            events += self._close("completed")
        return events

    def _say(self, text: str) -> list[dict]:
        if not text:  # (logprobs of tokens without text yet go with the next text)
            return []
        events = (
            []
            if self._open
            else self._start(
                {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            )
        )
        part = self._open["content"][0]
        part["text"] += text
        part["logprobs"] += self._logprobs
        events.append(
            self.event(
                "response.output_text.delta",
                item_id=self._open["id"],
                output_index=len(self.items) - 1,
                content_index=0,
                delta=text,
                logprobs=self._logprobs,
            )
        )
        self._logprobs = []
        return events

    def _start(self, item: dict) -> list[dict]:
        self._open = item
        self.items.append(item)
        index = len(self.items) - 1
        events = [self.event("response.output_item.added", output_index=index, item=copy.deepcopy(item))]
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=copy.deepcopy(part),
                )
            )
        return events

    def _close(self, status: str) -> list[dict]:
        item, self._open = self._open, None
        item["status"] = status
        index = len(self.items) - 1
        if item["type"] == "message":
            part = item["content"][0]
            part["logprobs"] += self._logprobs  # tokens that added no text (the calls' own, where calls follow)
            self._logprobs = []
            events = [
                self.event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    logprobs=part["logprobs"],
                ),
                self.event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=copy.deepcopy(part),
                ),
            ]
        else:
            events = [
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            ]
        return events + [self.event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]


def _function_call(name: str) -> dict:
    return {
        "id": new_id("fc"),
        "type": "function_call",
        "call_id": f"call_{uuid.uuid4().hex[:24]}",
        "name": name,
        "arguments": "",
        "status": "in_progress",
    }


@dataclass
class StoredResponse:
    response: dict
    conversation: list[dict]  # its turns and its answer's, without its instructions (previous_response_id's context)
    input_items: list[dict]  # its request's own input, as listed back


def page(items: list[dict], order: str, limit: int, after: str | None, before: str | None) -> dict:
    """A list endpoint's page (OpenAI's cursor pagination: `after` / `before` an item id, `order` asc or desc)."""
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    for cursor, name in ((after, "after"), (before, "before")):
        if cursor is not None and cursor not in ids:
            raise ResponsesError(f"{name}: no input item {cursor!r} in this response", name)
    start = ids.index(after) + 1 if after is not None else 0
    end = ids.index(before) if before is not None else len(ordered)
    data = ordered[start:end][:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + len(data) < end,
    }


class ResponseStore:
    """The last `capacity` stored responses, by id (the oldest forgotten first)."""

    def __init__(self, capacity: int = STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: dict, conversation: list[dict], inputs: list[dict]) -> None:
        self._responses[response["id"]] = StoredResponse(response, conversation, inputs)
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse:
        stored = self._responses.get(response_id)
        if stored is None:
            raise ResponsesError(
                f"no stored response with id {response_id!r} (responses created with store false, "
                f"deleted, or beyond the last {self.capacity}, are not kept)",
                "response_id",
                404,
            )
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._responses[response_id]
