"""Forced tool calls as schemas and back (the server's end-to-end test is in test_server.py)."""

from __future__ import annotations

import json

import pytest

from runner.serving.tool_calls import ToolRequestError, forced_tools

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now"}},
]


def test_named_and_required_schemas_and_their_calls():
    named = forced_tools(TOOLS, {"type": "function", "function": {"name": "weather"}})
    assert named.output_schema() == WEATHER
    (call,) = named.tool_calls('{"city": "Oslo"}')
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'} and call["id"].startswith("call_")
    assert named.tool_calls('{"city": "Os') is None  # cut by max_tokens: no call
    required = forced_tools(TOOLS, "required")
    schema = required.output_schema()
    assert schema["minItems"] == 1 and "maxItems" not in schema
    assert [s["properties"]["name"]["enum"] for s in schema["items"]["anyOf"]] == [["weather"], ["now"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    calls = required.tool_calls(
        '[{"name": "now", "parameters": {}}, {"name": "weather", "parameters": {"city": "Rome"}}]'
    )
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("now", {}),
        ("weather", {"city": "Rome"}),
    ]
    assert forced_tools(TOOLS, "required", parallel=False).output_schema()["maxItems"] == 1


def test_what_is_not_forced_or_not_possible():
    assert forced_tools(None, None) is None and forced_tools(None, "none") is None
    assert forced_tools(TOOLS, "none") is None
    for tools, choice, field in (
        (None, "required", "tool_choice"),  # a choice that forces a call needs tools to call
        ([], {"type": "function", "function": {"name": "f"}}, "tool_choice"),
        (TOOLS, "maybe", "tool_choice"),
        (TOOLS, None, "tool_choice"),
        (TOOLS, "auto", "tool_choice"),
        (TOOLS, {"type": "function", "function": {"name": "other"}}, "tool_choice"),
        ([{"type": "function", "function": {}}], "required", "tools"),
    ):
        with pytest.raises(ToolRequestError) as refused:
            forced_tools(tools, choice)
        assert refused.value.field == field
