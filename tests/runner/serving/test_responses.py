"""runner/serving/responses.py without a server: input items as chat turns, output items and their events, the store.
(The endpoint itself, against the chat endpoint's answers: tests/runner/serving/test_server.py.)"""

from __future__ import annotations

import pytest

from runner.serving.responses import (
    ResponseOutput,
    ResponsesError,
    ResponseStore,
    chat_tool_choice,
    chat_tools,
    chat_turns,
    input_items,
    output_turns,
    page,
    response_format,
)
from runner.serving.tool_calls import ForcedTools
from runner.serving.tool_parsers import PARSERS


def test_input_items_become_chat_turns():
    earlier = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    turns, added = chat_turns(
        [
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "roll "}, {"type": "input_text", "text": "twice"}],
            },
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Rolling."}]},
            {"type": "function_call", "call_id": "c1", "name": "roll", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "roll", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "4"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "6"}]},
        ],
        "Be brief.",
        earlier,
    )
    calls = [{"id": c, "type": "function", "function": {"name": "roll", "arguments": "{}"}} for c in ("c1", "c2")]
    assert added == [
        {"role": "user", "content": "roll twice"},
        {"role": "assistant", "content": "Rolling.", "tool_calls": calls},  # text and calls: one turn
        {"role": "tool", "tool_call_id": "c1", "content": "4"},
        {"role": "tool", "tool_call_id": "c2", "content": "6"},
    ]
    assert turns == [{"role": "system", "content": "Be brief."}, *earlier, *added]  # instructions first, not stored
    assert chat_turns("hello", None, []) == ([{"role": "user", "content": "hello"}],) * 2
    for items, message in (
        ([{"type": "reasoning"}], "not supported"),
        ([{"role": "robot", "content": "x"}], "role"),
        ([{"role": "user", "content": [{"type": "input_file"}]}], "text only"),
        ([{"type": "function_call", "name": "f"}], "call_id"),
        (["text"], "object"),
        ([], "empty"),
        ([{"type": "function_call_output", "call_id": "c", "output": 5}], "output"),
    ):
        with pytest.raises(ResponsesError, match=message):
            chat_turns(items, None, [])


def test_tools_tool_choice_and_text_format_in_the_chat_apis_shape():
    assert chat_tools([{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}]) == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    with pytest.raises(ResponsesError, match="web_search"):
        chat_tools([{"type": "web_search"}])
    assert chat_tool_choice({"type": "function", "name": "f"}) == {"type": "function", "function": {"name": "f"}}
    assert chat_tool_choice("required") == "required"
    with pytest.raises(ResponsesError):
        chat_tool_choice({"type": "allowed_tools"})
    schema = {"type": "object"}
    assert response_format({"format": {"type": "json_schema", "name": "x", "schema": schema}}) == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": schema},
    }
    assert response_format({"format": {"type": "text"}}) == {"type": "text"}
    with pytest.raises(ResponsesError, match="schema"):
        response_format({"format": {"type": "json_schema", "name": "x"}})


def test_a_streamed_answer_and_the_same_answer_at_once_give_the_same_items():
    """The builder behind both paths: fed token by token (a stream) or whole, the items match but for their ids,
    and the events open and close every item in order."""
    answer = 'Let me check. <tool_call>{"name": "roll", "arguments": {"sides": 6}}</tool_call>'
    for parser, tools, text, finish, kinds in (
        (None, None, "Paris is the capital.", "stop", ["message"]),
        (PARSERS["hermes"], None, answer, "stop", ["message", "function_call"]),
        (PARSERS["hermes"], None, answer[:30], "length", ["message"]),  # cut inside the call: text, incomplete
        (None, ForcedTools({"roll": {}}, "roll"), '{"sides": 6}', "stop", ["function_call"]),
        (
            None,
            ForcedTools({"roll": {}}, None),
            '[{"name": "roll", "parameters": {"sides": 6}}]',
            "stop",
            ["function_call"],
        ),
        (None, ForcedTools({"roll": {}}, None), '[{"name": "ro', "length", ["message"]),
    ):
        whole, pieces = ResponseOutput(tools, parser), ResponseOutput(tools, parser)
        whole.feed(text, [])
        whole.finish(text, finish)
        events = [e for i in range(0, len(text), 3) for e in pieces.feed(text[i : i + 3], [])]
        events += pieces.finish(text, finish)

        def without_ids(items):
            return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]

        assert without_ids(whole.items) == without_ids(pieces.items) and [i["type"] for i in whole.items] == kinds
        added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
        done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
        assert added == done == list(range(len(kinds)))
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        status = "incomplete" if finish == "length" else "completed"
        assert all(item["status"] == status for item in whole.items if item["type"] == "message")
    assert whole.items[0]["content"][0]["text"] == '[{"name": "ro'
    calls = ResponseOutput(None, PARSERS["hermes"])
    calls.feed(answer, [])
    calls.finish(answer, "stop")
    assert calls.items[0]["content"][0]["text"] == "Let me check. "
    assert (calls.items[1]["name"], calls.items[1]["arguments"]) == ("roll", '{"sides": 6}')
    assert output_turns(calls.items) == [
        {
            "role": "assistant",
            "content": "Let me check. ",
            "tool_calls": [
                {
                    "id": calls.items[1]["call_id"],
                    "type": "function",
                    "function": {"name": "roll", "arguments": '{"sides": 6}'},
                }
            ],
        }
    ]


def test_the_store_keeps_the_last_responses():
    store = ResponseStore(capacity=2)
    for name in "abc":
        store.put({"id": name}, [], [])
    with pytest.raises(ResponsesError) as err:
        store.get("a")
    assert err.value.status == 404
    assert store.get("c").response == {"id": "c"}
    store.delete("c")
    with pytest.raises(ResponsesError):
        store.delete("c")


def test_input_items_are_listed_back_with_ids_a_page_at_a_time():
    listed = input_items(
        [
            {"role": "user", "content": "hi"},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "4", "id": "mine"},
        ]
    )
    assert [i["type"] for i in listed] == ["message", "function_call", "function_call_output"]
    assert listed[0]["id"].startswith("msg_") and listed[1]["id"].startswith("fc_") and listed[2]["id"] == "mine"
    assert input_items("hi")[0]["content"] == listed[0]["content"] == [{"type": "input_text", "text": "hi"}]
    ids = [i["id"] for i in listed]
    first = page(listed, "desc", 2, None, None)
    assert [i["id"] for i in first["data"]] == ids[::-1][:2] and first["has_more"]
    rest = page(listed, "desc", 2, first["last_id"], None)
    assert [i["id"] for i in rest["data"]] == [ids[0]] and not rest["has_more"]
    assert [i["id"] for i in page(listed, "asc", 20, None, ids[2])["data"]] == ids[:2]
    with pytest.raises(ResponsesError, match="after"):
        page(listed, "asc", 20, "nope", None)
