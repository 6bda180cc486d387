"""Tool calls the client forces (OpenAI's `tool_choice`: a named function, or "required"), made by structured outputs
as vLLM makes them: the answer is constrained to the function's parameters schema (named), or to a JSON array of
{"name", "parameters"} objects, one of the tools each (required), and returned as `tool_calls`.

That needs nothing of the model's own tool-call format. `tool_choice: "auto"` does: the model decides whether to
call, in the syntax its chat template taught it, which needs a parser per model family (runner/serving/tool_parsers.py,
`runner serve --tool-call-parser`); without one the server refuses it rather than guess.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from runner.serving.tool_parsers import PARSERS


class ToolRequestError(ValueError):
    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field  # the request field at fault: "tools" or "tool_choice"


@dataclass(frozen=True)
class ForcedTools:
    """What the client forces: `name` (one function's arguments) or None (a list of calls to any of `schemas`)."""

    schemas: dict[str, dict]  # function name -> its parameters' JSON schema
    name: str | None
    parallel: bool = True  # several calls allowed (OpenAI's parallel_tool_calls)

    def output_schema(self) -> dict:
        """The JSON schema the answer is held to."""
        if self.name is not None:
            return self.schemas[self.name]
        calls = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in self.schemas.items()
        ]
        return {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **({} if self.parallel else {"maxItems": 1})}

    def tool_calls(self, text: str) -> list[dict] | None:
        """OpenAI `tool_calls` from a finished answer; None when it is not complete JSON (cut by max_tokens)."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if self.name is not None:  # the arguments as generated (and as streamed)
            return [tool_call(self.name, text)]
        return [tool_call(call["name"], json.dumps(call["parameters"], ensure_ascii=False)) for call in value]


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict:
    return {
        "id": call_id or f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def forced_tools(
    tools: list[dict[str, Any]] | None, tool_choice: str | dict | None, parallel: bool = True, auto: bool = False
) -> ForcedTools | None:
    """The tools a request forces, None when it forces none ("none", no tools, or "auto" where the server parses
    the model's own calls: `auto`); ToolRequestError for what the server cannot do ("auto" without a parser) or
    malformed tools."""
    named = isinstance(tool_choice, dict)
    if not named and tool_choice not in (None, "none", "auto", "required"):
        raise ToolRequestError(
            f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": {{"name": ...}}}}, '
            f"not {tool_choice!r}",
            "tool_choice",
        )
    if not tools and (named or tool_choice == "required"):
        raise ToolRequestError(f"tool_choice {tool_choice!r} needs tools, and the request has none", "tool_choice")
    if not tools or tool_choice == "none":
        return None
    schemas = {}
    for tool in tools:
        function = (
            tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        )
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolRequestError(
                'each tool must be {"type": "function", "function": {"name": ..., "parameters": ...}}', "tools"
            )
        schemas[function["name"]] = function.get("parameters") or {"type": "object", "properties": {}}
    if tool_choice in (None, "auto"):
        if auto:
            return None
        raise ToolRequestError(
            'tool_choice "auto" (the default with tools) needs a parser for this model\'s own tool-call syntax: start '
            f'the server with --tool-call-parser ({", ".join(PARSERS)}), or use tool_choice "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if tool_choice == "required":
        return ForcedTools(schemas, None, parallel)
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if name not in schemas:
        raise ToolRequestError(f"tool_choice names {name!r}, which is not one of the tools", "tool_choice")
    return ForcedTools(schemas, name)
