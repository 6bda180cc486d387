"""Reading the tool calls a model makes by itself (tool_choice "auto"): each family's syntax, text that only looks
like a call, and what a stream may send before the answer is complete."""

from __future__ import annotations

import json

from runner.serving.tool_parsers import AutoToolStream, HermesParser, Llama3JsonParser, PythonicParser

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def test_hermes_blocks_after_some_content():
    parser = HermesParser()
    text = (
        f'Let me check. <tool_call>\n{WEATHER}\n</tool_call><tool_call>{{"name": "now", "arguments": {{}}}}</tool_call>'
    )
    parsed = parser.parse(text)
    assert text[: parsed.content_end] == "Let me check. "
    assert [(name, json.loads(arguments)) for name, arguments in parsed.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("now", {}),
    ]
    assert parser.parse(f"<tool_call>{WEATHER}").calls == [("get_weather", '{"city": "Paris"}')]  # no closing tag
    for text in ("Just text.", "<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>'):
        assert parser.parse(text).calls == [] and parser.parse(text).content_end == len(text)  # stays text


def test_llama3_json_calls_are_the_whole_answer():
    parser = Llama3JsonParser()
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert parser.parse(one).calls == [("get_weather", '{"city": "Paris"}')] and parser.parse(one).content_end == 0
    assert [name for name, _ in parser.parse(f"<|python_tag|>{one}; {one}").calls] == ["get_weather"] * 2
    for text in ('{"city": "Paris"}', f"{one} and then some words", "The answer is {}", f"{one[:-3]}"):
        assert parser.parse(text).calls == []  # a JSON answer, trailing text, prose, a cut call: text


def test_pythonic_calls_are_a_list_of_calls_with_literal_arguments():
    parser = PythonicParser()
    parsed = parser.parse('[get_weather(city="Paris", days=[1, 2]), now()]')
    assert parsed.content_end == 0
    assert [(name, json.loads(arguments)) for name, arguments in parsed.calls] == [
        ("get_weather", {"city": "Paris", "days": [1, 2]}),
        ("now", {}),
    ]
    for text in (
        "[1, 2, 3]",
        "[f(x)]",
        "[f(x=y)]",
        "[f(**kw)]",
        "[os.system(c='ls')]",
        "[]",
        "Sure: [f(x=1)]",
        "[f(x=1",
    ):
        assert parser.parse(text).calls == []  # a plain list, positional or non-literal arguments, prose, a cut call
    assert parser.streamable(" [f(") == 0 and parser.streamable("Hello") == 5


def test_streams_send_content_until_a_call_may_begin():
    hermes = AutoToolStream(HermesParser())
    pieces = [hermes.push("0", piece)[1] for piece in ("Let me ", "check. <tool", "_call>", '{"name"')]
    assert pieces == ["Let me ", "check. ", "", ""]  # "<tool" might begin a call: held until it is one
    assert hermes.rest("0", len("Let me check. ")) == ""
    words = AutoToolStream(HermesParser())
    assert [words.push("1", piece)[1] for piece in ("a <", "b")] == ["a ", "<b"]  # it was not one
    llama = AutoToolStream(Llama3JsonParser())
    assert [llama.push("0", piece)[1] for piece in (" ", "{", '"name"')] == ["", "", ""]
    prose = AutoToolStream(Llama3JsonParser())
    assert [prose.push("0", piece)[1] for piece in ("Hello", " there")] == ["Hello", " there"]
