"""The real server on a loopback port, driven by the official `openai` client (and raw HTTP for bad input)."""

from __future__ import annotations

import concurrent.futures
import json
import re
import socket
import threading
import time

import httpx
import openai
import pytest

from plugins import native_ops
from runner.core.args import EngineArgs
from runner.core.async_engine import AsyncEngine, EngineOverloaded
from runner.core.engine import LLMEngine
from runner.sampling.structured import DEFAULT_GRAMMAR_TIMEOUT

MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveServer:
    def __init__(
        self,
        engine_dir,
        max_batch=None,
        max_waiting=64,
        enable_prefix_caching=False,
        api_key=None,
        speculative_max_rows=1,
        tool_call_parser=None,
        chat_template=None,
        generation_config="auto",
        allowed_origins=None,
        max_model_len=None,
        max_body_bytes=8 * 2**20,
        special_tokens_in_content=False,
        grammar_timeout=DEFAULT_GRAMMAR_TIMEOUT,  # runner serve's
    ) -> None:
        import uvicorn

        from runner.serving.app import ServerConfig, create_app

        engine = LLMEngine(
            EngineArgs(
                engine_dir,
                max_batch=max_batch,
                enable_prefix_caching=enable_prefix_caching,
                speculative_max_rows=speculative_max_rows,
                chat_template=chat_template,
                generation_config=generation_config,
                max_model_len=max_model_len,
                grammar_timeout=grammar_timeout,
            )
        )
        self.engine = AsyncEngine(engine, max_waiting=max_waiting)
        self.port = free_port()
        config = ServerConfig(
            MODEL, 2.0, api_key, tool_call_parser, allowed_origins or [], max_body_bytes, special_tokens_in_content
        )
        app = create_app(self.engine, config)
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key or "none", max_retries=0, timeout=60)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module", params=[1, 2], ids=["one_rank", "two_ranks"])
def server(engine_factory, request):
    """The tiny engine served; also as a tensor-parallel engine of two ranks, where our kernels can be built."""
    if request.param > 1 and native_ops.unavailable_reason():
        pytest.skip(f"tensor-parallel engines need our kernel library: {native_ops.unavailable_reason()}")
    live = LiveServer(engine_factory("gqa", tensor_parallel=request.param))
    yield live
    live.stop()


def chat(server, content="hello", **kwargs):
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("max_tokens", 12)
    return server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kwargs)


def test_models_health_and_metrics(server):
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    assert server.client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        server.client.models.retrieve("gpt-9")
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/version").json()["version"]
    for response, status in (
        (httpx.get(f"{server.url}/v1/no-such-route"), 404),
        (httpx.get(f"{server.url}/v1/chat/completions"), 405),
    ):
        assert response.status_code == status and response.json()["error"]["code"] == status  # OpenAI error objects
    chat(server)
    metrics = httpx.get(f"{server.url}/metrics").text
    for name in (
        "engine_requests_waiting",
        "engine_requests_running",
        "engine_time_to_first_token_seconds_bucket",
        "engine_inter_token_latency_seconds_bucket",
        "engine_generation_tokens_total",
        "engine_generation_tokens_per_second",
        "engine_kv_cache_resident_bytes",
        "engine_request_latency_seconds_bucket",
    ):
        assert name in metrics
    assert re.search(r'engine_requests_finished_total\{finish_reason="length"\} [1-9]', metrics)
    for vllm in (
        'vllm:num_requests_running{model_name="tiny"} 0.0',
        'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="tiny"}',
        'vllm:inter_token_latency_seconds_count{model_name="tiny"}',
        "vllm:e2e_request_latency_seconds_sum",
        'vllm:generation_tokens_total{model_name="tiny"}',
        'vllm:prompt_tokens_total{model_name="tiny"}',
    ):
        assert vllm in metrics  # vLLM's names for the same series, for dashboards written for vLLM
    assert re.search(r'vllm:request_success_total\{finished_reason="length",model_name="tiny"\} [1-9]', metrics)


def test_chat_streaming_equals_non_streaming_with_usage(server):
    full = chat(server, extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 12
    stream = chat(server, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-2].choices[0].finish_reason == "length"


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(server, engine_factory):
    answer = server.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.prompt_tokens + answer.usage.completion_tokens == server.engine.engine.max_seq_len
    live = LiveServer(engine_factory("gqa"), max_model_len=40)  # vLLM's --max-model-len: shorter than the build's
    try:
        assert live.client.models.retrieve(MODEL).max_model_len == 40
        answer = chat(live, max_tokens=None, extra_body={"ignore_eos": True})
        assert answer.usage.prompt_tokens + answer.usage.completion_tokens == 40
        with pytest.raises(openai.BadRequestError, match="40"):
            chat(live, "hello " * 40)
    finally:
        live.stop()
    with pytest.raises(ValueError, match="max_model_len"):
        LLMEngine(EngineArgs(engine_factory("gqa"), max_model_len=10_000))


def test_completions_streaming_and_not(server):
    full = server.client.completions.create(
        model=MODEL, prompt="The quick brown", max_tokens=10, temperature=0.0, extra_body={"ignore_eos": True}
    )
    streamed = server.client.completions.create(
        model=MODEL,
        prompt="The quick brown",
        max_tokens=10,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in streamed) == full.choices[0].text
    assert full.usage.completion_tokens == 10
    batch = server.client.completions.create(
        model=MODEL,
        prompt=["hello", "The quick brown"],
        max_tokens=10,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in batch.choices) == [0, 1]
    assert next(c for c in batch.choices if c.index == 1).text == full.choices[0].text


def test_n_seeds_and_logprobs(server):
    first = chat(server, temperature=1.0, seed=11, n=3, extra_body={"ignore_eos": True})
    again = chat(server, temperature=1.0, seed=11, n=3, extra_body={"ignore_eos": True})
    texts = [c.message.content for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.message.content for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # completion i samples with seed + i
    with_logprobs = chat(server, logprobs=True, top_logprobs=3, max_tokens=4)
    content = with_logprobs.choices[0].logprobs.content
    assert len(content) == len(with_logprobs.choices[0].message.content) or len(content) == 4
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)  # greedy takes the top


def test_echo_returns_the_prompt_and_its_logprobs_as_lm_eval_asks(server):
    """lm-evaluation-harness scores a continuation with echo + logprobs + max_tokens 1 on token ids: the prompt's
    text and tokens come first, the first token's logprob null, then each prompt token's logprob given the ones
    before it (the engine's prompt_logprobs, checked against transformers in tests/runner/sampling/test_logprobs.py)."""
    prompt = [int(t) for t in server.engine.engine.codec.encode("The quick brown fox jumps over the lazy dog.")]
    plain = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0.0, logprobs=1)
    echoed = server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0.0, logprobs=1, echo=True
    )
    choice = echoed.choices[0]
    prompt_text = server.engine.engine.codec.decode(prompt)
    assert choice.text == prompt_text + plain.choices[0].text
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt) + 1 and logprobs.tokens[-1] == plain.choices[0].logprobs.tokens[0]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp < 0 for lp in logprobs.token_logprobs[1:])
    assert logprobs.token_logprobs[-1] == pytest.approx(plain.choices[0].logprobs.token_logprobs[0], abs=1e-4)
    streamed = list(
        server.client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=3,
            temperature=0.0,
            echo=True,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert streamed[0].choices[0].text.startswith(prompt_text)
    text_only = server.client.completions.create(
        model=MODEL, prompt="The quick brown", max_tokens=4, temperature=0.0, echo=True
    )
    assert text_only.choices[0].text.startswith("The quick brown") and text_only.choices[0].logprobs is None
    # max_tokens 0 + echo (OpenAI's legacy scoring call): the prompt alone, streamed or not, nothing generated
    scored = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, logprobs=1, echo=True)
    assert scored.choices[0].text == prompt_text and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs == logprobs.token_logprobs[:-1]
    assert scored.choices[0].finish_reason == "length"
    chunks = list(server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == prompt_text
    # vLLM's prompt_logprobs: per prompt token {id: {logprob, rank, decoded_token}}, the token and the top ones
    vllm_style = server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    entries = vllm_style.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    for position, entry in enumerate(entries[1:], start=1):
        own = entry[str(prompt[position])]
        assert own["logprob"] == pytest.approx(logprobs.token_logprobs[position], abs=1e-6) and own["rank"] >= 1
        assert len(entry) in (2, 3) and {e["rank"] for t, e in entry.items() if t != str(prompt[position])} <= {1, 2}
    chat_style = chat(server, max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert chat_style.model_extra["prompt_logprobs"][0] is None
    for body in (
        {"prompt": "hi", "max_tokens": 0},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
        {"prompt": "hi", "prompt_logprobs": 1, "stream": True},
    ):
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        response = httpx.post(f"{server.url}{path}", json={"model": MODEL, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] in ("max_tokens", "prompt_logprobs")


def test_structured_outputs_by_openai_and_vllm_names(server):
    pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (scripts/test.sh installs it)")
    choices = ["alpha", "beta", "gamma delta"]
    answer = chat(server, temperature=1.0, seed=2, n=4, extra_body={"guided_choice": choices})
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in answer.choices)
    streamed = server.client.completions.create(
        model=MODEL,
        prompt="hello",
        max_tokens=30,
        temperature=1.0,
        seed=4,
        stream=True,
        extra_body={"structured_outputs": {"regex": "[0-9]{4}"}},
    )
    assert re.fullmatch("[0-9]{4}", "".join(c.choices[0].text for c in streamed))
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    for response_format in (
        {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        {"type": "json_object"},
    ):
        outs = chat(server, temperature=1.0, seed=7, n=4, max_tokens=60, response_format=response_format).choices
        parsed = [json.loads(c.message.content) for c in outs if c.finish_reason == "stop"]
        assert parsed and (response_format["type"] == "json_object" or all(set(p) == {"ok"} for p in parsed))
    for extra, message in (
        ({"guided_regex": "[0-9"}, "cannot compile"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "one structured"),
        ({"response_format": {"type": "yaml"}}, "not one of"),
        ({"structured_outputs": {"grammar": "x"}}, "supports"),
    ):
        with pytest.raises(openai.BadRequestError, match=message):
            chat(server, extra_body=extra)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "roll",
            "parameters": {
                "type": "object",
                "properties": {"sides": {"type": "integer", "enum": [6, 20]}},
                "required": ["sides"],
                "additionalProperties": False,
            },
        },
    },
]


def test_forced_tool_calls_streamed_and_not(server):
    """tool_choice naming a function or "required" makes the answer tool_calls whose arguments follow the tool's
    schema, whatever the (random) model would say; "auto" needs a parser for the model's syntax and is refused."""
    pytest.importorskip("xgrammar", reason="tool calls are structured outputs (scripts/test.sh installs xgrammar)")
    named = {"type": "function", "function": {"name": "roll"}}
    message = chat(server, max_tokens=60, tools=TOOLS, tool_choice=named).choices[0]
    (call,) = message.message.tool_calls
    assert message.finish_reason == "stop" and message.message.content is None
    assert call.function.name == "roll" and json.loads(call.function.arguments)["sides"] in (6, 20)
    streamed = list(
        server.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=60,
            temperature=0.0,
            tools=TOOLS,
            tool_choice=named,
            stream=True,
        )
    )
    first = streamed[0].choices[0].delta.tool_calls[0]
    assert first.id and first.function.name == "roll"
    arguments = "".join(
        c.choices[0].delta.tool_calls[0].function.arguments or "" for c in streamed if c.choices[0].delta.tool_calls
    )
    assert arguments == call.function.arguments  # the same greedy answer, in pieces
    for stream in (False, True):
        response = server.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=200,
            temperature=1.0,
            seed=3,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            stream=stream,
        )
        if stream:
            last = [c for c in response if c.choices][-1].choices[0]
            calls, finish = last.delta.tool_calls, last.finish_reason
        else:
            calls, finish = response.choices[0].message.tool_calls, response.choices[0].finish_reason
        assert finish == "tool_calls" and len(calls) == 1
        for c in calls:
            arguments = json.loads(c.function.arguments)
            assert (c.function.name, set(arguments)) in (("get_time", {"zone"}), ("roll", {"sides"}))
    assert chat(server, max_tokens=3, tools=TOOLS, tool_choice="none").choices[0].message.content
    for kwargs, message in (
        ({"tools": TOOLS}, "auto"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "not one of"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "structured output"),
    ):
        with pytest.raises(openai.BadRequestError, match=message):
            chat(server, **kwargs)


def test_auto_tool_calls_are_read_in_the_models_own_syntax(engine_factory):
    """With a tool-call parser, tool_choice "auto" lets the model decide: a call it writes in its family's syntax
    (forced by a regex here: a random model would not write one) comes back as tool_calls, streamed or not, after
    the text before it; an answer without one stays text; a chat template that does not show the model its tools
    is refused."""
    pytest.importorskip("xgrammar", reason="the regex that writes the call is a structured output")
    live = LiveServer(engine_factory("gqa"), tool_call_parser="hermes")
    try:
        with pytest.raises(openai.BadRequestError, match="does not show tools"):
            chat(live, tools=TOOLS)
        live.stop()
        template = (
            live.engine.engine.manifest.tokenizer.chat_template + "{% if tools %}{{ tools | length }} tools{% endif %}"
        )
        live = LiveServer(engine_factory("gqa"), tool_call_parser="hermes", chat_template=template)  # --chat-template
        regex = r'Let me check\. <tool_call>\{"name": "roll", "arguments": \{"sides": 6\}\}</tool_call>'
        answer = chat(live, max_tokens=80, tools=TOOLS, extra_body={"guided_regex": regex}).choices[0]
        (call,) = answer.message.tool_calls
        assert answer.finish_reason == "tool_calls" and answer.message.content == "Let me check."
        assert call.id and call.function.name == "roll" and json.loads(call.function.arguments) == {"sides": 6}
        chunks = [
            c.choices[0]
            for c in chat(live, max_tokens=80, tools=TOOLS, stream=True, extra_body={"guided_regex": regex})
        ]
        assert (
            "".join(c.delta.content or "" for c in chunks) == "Let me check. " and chunks[0].delta.role == "assistant"
        )
        assert chunks[-1].finish_reason == "tool_calls" and chunks[-1].delta.tool_calls[0].function.name == "roll"
        response = live.client.responses.create(
            model=MODEL,
            input="hello",
            temperature=0.0,
            max_output_tokens=80,
            extra_body={"guided_regex": regex},
            tools=[{"type": "function", **tool["function"]} for tool in TOOLS],
        )  # the Responses API's tool shape
        message, call = response.output
        assert message.content[0].text == "Let me check. " and (call.type, call.name) == ("function_call", "roll")
        assert json.loads(call.arguments) == {"sides": 6} and response.status == "completed"
        text = chat(live, max_tokens=6, tools=TOOLS, extra_body={"ignore_eos": True}).choices[0]
        assert text.message.tool_calls is None and text.message.content and text.finish_reason == "length"
    finally:
        live.stop()


def respond(server, text="hello", **kwargs):
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("max_output_tokens", 12)
    return server.client.responses.create(model=MODEL, input=text, **kwargs)


def test_responses_api_answers_as_chat_does_streamed_or_not(server):
    """/v1/responses is the chat endpoint under OpenAI's newer API: the same greedy answer, as an output message;
    the stream (read by the openai client's own accumulating helper, which checks the events' order and ids) ends
    with the same response; a cut answer is "incomplete"."""
    eos = {"ignore_eos": True}
    answer = chat(server, extra_body=eos)
    response = respond(server, extra_body=eos)
    assert response.output_text == answer.choices[0].message.content and response.object == "response"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (answer.usage.prompt_tokens, 12)
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    with server.client.responses.stream(
        model=MODEL, input="hello", temperature=0.0, max_output_tokens=12, extra_body=eos
    ) as stream:
        events = list(stream)
    final = events[-1].response  # (the helper's get_final_response wants response.completed: see the tools test)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [events[0].type, events[1].type, events[-1].type] == [
        "response.created",
        "response.in_progress",
        "response.incomplete",
    ]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    assert final.output_text == response.output_text and final.id == events[0].response.id
    assert final.output[0].id == next(e.item.id for e in events if e.type == "response.output_item.added")

    system = server.client.chat.completions.create(
        model=MODEL,
        temperature=0.0,
        max_tokens=12,
        extra_body=eos,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
    )
    assert respond(server, instructions="Be brief.", extra_body=eos).output_text == system.choices[0].message.content
    parts = [{"role": "user", "content": [{"type": "input_text", "text": "hel"}, {"type": "input_text", "text": "lo"}]}]
    assert respond(server, parts, extra_body=eos).output_text == response.output_text

    with_logprobs = respond(
        server, max_output_tokens=4, include=["message.output_text.logprobs"], top_logprobs=2, extra_body=eos
    )
    logprobs = with_logprobs.output[0].content[0].logprobs
    assert len(logprobs) == 4 and all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)
    assert all(lp.logprob == pytest.approx(lp.top_logprobs[0].logprob) for lp in logprobs)  # greedy takes the top
    assert all(bytes(lp.bytes).decode() == lp.token for lp in logprobs if "\ufffd" not in lp.token)


def test_responses_chain_by_previous_response_id_and_are_stored(server):
    """previous_response_id continues the stored conversation (its instructions are not carried over, as OpenAI
    has it): the same greedy answer as the whole chat sent to /v1/chat/completions; stored responses can be read
    back and deleted; store false keeps nothing."""
    eos = {"ignore_eos": True}
    first = respond(server, "hello", instructions="Be brief.", extra_body=eos)
    second = respond(server, "tell me more", previous_response_id=first.id, extra_body=eos)
    whole = server.client.chat.completions.create(
        model=MODEL,
        temperature=0.0,
        max_tokens=12,
        extra_body=eos,
        messages=[
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "tell me more"},
        ],
    )
    assert second.output_text == whole.choices[0].message.content and second.previous_response_id == first.id
    assert server.client.responses.retrieve(first.id).output_text == first.output_text
    listed = server.client.responses.input_items.list(second.id)
    assert [(i.type, i.content[0].text) for i in listed.data] == [("message", "tell me more")]
    server.client.responses.delete(first.id)
    for gone in (first.id, respond(server, store=False).id):
        with pytest.raises(openai.NotFoundError):
            server.client.responses.retrieve(gone)
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        respond(server, "again", previous_response_id=first.id)
    assert chat(server).choices[0].message.content  # still serving


def test_responses_api_tools_and_bad_requests(server):
    """Function tools in the Responses shape: a named function's call streams its arguments and matches the
    non-streamed one; a call's result (function_call + function_call_output items) reads as the chat API's tool
    turns; what the server does not do is a 400 naming the field."""
    pytest.importorskip(
        "xgrammar", reason="forced tool calls are structured outputs (scripts/test.sh installs xgrammar)"
    )
    tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    named = {"type": "function", "name": "roll"}
    response = respond(server, tools=tools, tool_choice=named, max_output_tokens=60)
    (call,) = response.output
    assert call.type == "function_call" and call.name == "roll" and call.call_id and response.status == "completed"
    assert json.loads(call.arguments)["sides"] in (6, 20)
    with server.client.responses.stream(
        model=MODEL, input="hello", temperature=0.0, max_output_tokens=60, tools=tools, tool_choice=named
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()  # a response.completed the helper accepts
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    assert final.output[0].arguments == call.arguments and final.output[0].name == "roll"
    required = respond(
        server,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=1.0,
        extra_body={"seed": 3},
    )
    assert [item.type for item in required.output] == ["function_call"] and required.output[0].name in (
        "roll",
        "get_time",
    )

    result = [
        {"role": "user", "content": "roll a die"},
        {"type": "function_call", "call_id": "call_1", "name": "roll", "arguments": '{"sides": 6}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "4"},
    ]
    as_chat = server.client.chat.completions.create(
        model=MODEL,
        temperature=0.0,
        max_tokens=12,
        messages=[
            {"role": "user", "content": "roll a die"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "roll", "arguments": '{"sides": 6}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "4"},
        ],
    )
    assert respond(server, result).output_text == as_chat.choices[0].message.content

    for kwargs, field in (
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
        ({"extra_body": {"n": 2}}, "n"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"tools": tools}, "tool_choice"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            respond(server, **kwargs)
        assert err.value.body["param"] == field
    with pytest.raises(openai.BadRequestError, match="text only"):
        respond(server, [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])
    with pytest.raises(openai.NotFoundError):
        server.client.responses.create(model="gpt-9", input="hello")


def test_fields_a_request_leaves_unset_take_the_models_recommended_values(recommending_engine):
    """As vLLM's --generation-config auto: the model recommends top_k 1, repetition_penalty 1.3 and at most 5 new
    tokens, so a request that sets none of them gets the greedy answer under that penalty; what a request sets wins;
    --generation-config vllm restores vLLM's defaults."""
    live = LiveServer(recommending_engine)
    try:
        eos = {"ignore_eos": True}
        unset = live.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], extra_body=eos
        )
        explicit = chat(live, max_tokens=5, extra_body={**eos, "repetition_penalty": 1.3})
        assert unset.choices[0].message.content == explicit.choices[0].message.content
        assert unset.usage.completion_tokens == 5
        assert chat(live, max_tokens=9, extra_body=eos).usage.completion_tokens == 9
        responses = live.client.responses.create(model=MODEL, input="hello", extra_body=eos)
        assert responses.output_text == explicit.choices[0].message.content
        completion = live.client.completions.create(model=MODEL, prompt="hello", extra_body=eos)
        assert completion.usage.completion_tokens == 5  # (not the completions API's 16)
    finally:
        live.stop()
    live = LiveServer(recommending_engine, generation_config="vllm")
    try:
        answer = live.client.completions.create(model=MODEL, prompt="hello", extra_body={"ignore_eos": True})
        assert answer.usage.completion_tokens == 16
    finally:
        live.stop()


def test_tokenize_and_detokenize_count_what_the_endpoints_send(server):
    def post(path, body):
        return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body})

    messages = [{"role": "user", "content": "hello there"}]
    chat_usage = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    counted = post("/tokenize", {"messages": messages}).json()
    assert counted["count"] == chat_usage.prompt_tokens and counted["max_model_len"] == server.engine.engine.max_seq_len
    plain = post("/tokenize", {"prompt": "hello there"}).json()
    assert (
        plain["count"]
        == server.client.completions.create(model=MODEL, prompt="hello there", max_tokens=1).usage.prompt_tokens
    )
    assert post("/detokenize", {"tokens": plain["tokens"]}).json() == {"prompt": "hello there"}
    assert post("/tokenize", {}).status_code == 400
    assert post("/detokenize", {"tokens": [10**7]}).json()["error"]["param"] == "tokens"
    assert httpx.post(f"{server.url}/tokenize", json={"model": "gpt-9", "prompt": "x"}).status_code == 404


def test_vllm_request_extras_reach_the_engine(server):
    """vLLM's sampling and chat-template extras are honoured (the engine-level behaviour: tests/runner/test_llm.py)."""
    codec = server.engine.engine.codec
    greedy = dict(temperature=0.0, max_tokens=8)
    allowed = [5, 9, 13]
    out = chat(
        server,
        **greedy,
        logprobs=True,
        top_logprobs=2,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    tokens = [c.token for c in out.choices[0].logprobs.content]
    assert len(tokens) == 8 and {t for t in tokens} <= {f"token_id:{t}" for t in allowed}
    assert all(t.token.startswith("token_id:") for c in out.choices[0].logprobs.content for t in c.top_logprobs)

    def token_ids(**extra) -> list[int]:
        answer = chat(
            server,
            **greedy,
            logprobs=True,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, **extra},
        )
        return [int(c.token.removeprefix("token_id:")) for c in answer.choices[0].logprobs.content]

    full = token_ids()
    word = next(
        w for w in map(lambda t: codec.decode([t]), full) if w.strip() and len(codec.encode(w.strip(), False)) == 1
    )
    banned = codec.encode(word.strip(), False)[0]
    without = token_ids(bad_words=[word])
    assert banned in full and banned not in without and without != full
    special = chat(
        server, max_tokens=2, logit_bias={"1": 100}, extra_body={"ignore_eos": True, "skip_special_tokens": False}
    )
    assert special.choices[0].message.content == "<|im_start|>" * 2
    truncated = server.client.completions.create(
        model=MODEL, prompt="one two three four five six", max_tokens=1, extra_body={"truncate_prompt_tokens": 3}
    )
    assert truncated.usage.prompt_tokens == 3
    # the chat template's controls: go on with a final assistant message, and echo it (vLLM's chat echo)
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Once upon"}]
    body = {"add_generation_prompt": False, "continue_final_message": True}
    counted = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": messages, **body}).json()
    assert codec.decode(counted["tokens"], skip_special_tokens=False).endswith("<|im_start|>assistant\nOnce upon")
    going_on = server.client.chat.completions.create(model=MODEL, messages=messages, **greedy, extra_body=body)
    echoed = server.client.chat.completions.create(
        model=MODEL, messages=messages, **greedy, extra_body={**body, "echo": True}
    )
    assert going_on.usage.prompt_tokens == counted["count"]
    assert echoed.choices[0].message.content == "Once upon" + going_on.choices[0].message.content
    streamed = server.client.chat.completions.create(
        model=MODEL, messages=messages, **greedy, stream=True, extra_body={**body, "echo": True}
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == echoed.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="exclude each other"):
        server.client.chat.completions.create(
            model=MODEL, messages=messages, extra_body={"continue_final_message": True}
        )
    with pytest.raises(openai.BadRequestError, match="cannot set messages"):
        chat(server, extra_body={"chat_template_kwargs": {"messages": []}})
    # the usage so far in every chunk, and the response id from the request's
    chunks = list(
        chat(
            server,
            **greedy,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={
                "request_id": "abc",
                "ignore_eos": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
        )
    )
    assert {c.id for c in chunks} == {"chatcmpl-abc"}
    stopped = chat(server, **greedy, extra_body={"ignore_eos": True, "stop_token_ids": [full[2]]})
    assert stopped.choices[0].model_extra["stop_reason"] == full[2]  # vLLM's: the stop token id that ended it
    assert [c.usage.completion_tokens for c in chunks if c.choices] == list(range(1, 9))


def test_logit_bias(server):
    forced = chat(server, max_tokens=3, logit_bias={"7": 100}, extra_body={"ignore_eos": True}, logprobs=True)
    assert [c.token for c in forced.choices[0].logprobs.content] == [server.engine.engine.codec.decode([7])] * 3
    # the model's own log-probability, not the biased one (which would be ~0)
    assert all(c.logprob < -1e-3 for c in forced.choices[0].logprobs.content)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        chat(server, logit_bias={"7": 200})


def test_16_concurrent_streams_equal_the_same_requests_run_one_at_a_time(server):
    prompts = [f"request {i}: " + "hello world " * (i % 5) for i in range(16)]

    def stream(prompt):
        chunks = server.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0.0, stream=True, extra_body={"ignore_eos": True}
        )
        return "".join(c.choices[0].text for c in chunks)

    alone = [stream(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(stream, prompts))
    assert together == alone


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server):
    def post(body, path="/v1/chat/completions"):
        return httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"})

    with pytest.raises(openai.NotFoundError, match="the model 'gpt-9' does not exist") as missing:
        server.client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["type"] == "not_found_error" and missing.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError, match="max sequence length"):
        chat(server, content="hello " * 600)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        chat(server, temperature=-2)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        chat(server, top_p=7)
    response = post("{not json")
    assert response.status_code == 400 and "malformed JSON" in response.json()["error"]["message"]
    response = post('{"model": "tiny"}')
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "messages" and error["type"] == "invalid_request_error"
    assert "messages" in error["message"]
    response = post('{"model": "tiny", "prompt": [[]]}', "/v1/completions")
    assert response.status_code == 400 and "empty" in response.json()["error"]["message"]
    # OpenAI fields the server does not implement are refused, not silently ignored; their neutral values pass
    # (and vLLM's extras that it does not implement)
    for field, value in (
        ("functions", [{"name": "f"}]),
        ("function_call", "f"),
        ("guided_grammar", "root ::= x"),
        ("use_beam_search", True),
        ("priority", 1),
        ("chat_template", "{{ messages }}"),
    ):
        with pytest.raises(openai.BadRequestError, match=f"{field} is not supported") as refused:
            chat(server, extra_body={field: value})
        assert refused.value.body["param"] == field
    for field, value in (("suffix", "end"), ("best_of", 3)):
        response = post(json.dumps({"model": "tiny", "prompt": "hi", field: value}), "/v1/completions")
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == field and "not supported" in error["message"]
    assert chat(
        server,
        extra_body={
            "response_format": {"type": "text"},
            "tools": [],
            "user": "u",
            "store": False,
            "use_beam_search": False,
            "priority": 0,
            "length_penalty": 1.0,
        },
    )
    # null means "not given", as OpenAI reads it (some clients send every optional parameter as null)
    nulls = {
        name: None
        for name in (
            "temperature",
            "top_p",
            "n",
            "stream",
            "stop",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "logprobs",
            "top_logprobs",
            "logit_bias",
            "tools",
            "user",
        )
    }
    response = post(
        json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **nulls})
    )
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1
    response = post(
        json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 3, "echo": None, **nulls}), "/v1/completions"
    )
    assert response.status_code == 200
    error = post(json.dumps({"model": "tiny", "messages": None})).json()["error"]
    assert error["param"] == "messages" and "messages" in error["message"]
    assert chat(server).choices[0].message.content is not None


def test_a_disconnected_stream_frees_its_row(engine_factory):
    live = LiveServer(engine_factory("gqa"), max_batch=1)
    try:
        scheduler = live.engine.engine.scheduler
        streams = (
            ("/v1/completions", {"prompt": "hello", "max_tokens": 200}, "data: "),
            ("/v1/responses", {"input": "hello", "max_output_tokens": 200}, "event: "),
        )
        for aborted, (path, fields, first_line) in enumerate(streams, start=1):
            with httpx.stream(
                "POST",
                f"{live.url}{path}",
                json={
                    "model": MODEL,
                    **fields,
                    "stream": True,
                    "ignore_eos": True,
                    "temperature": 0,
                },
            ) as response:
                lines = response.iter_lines()
                assert next(lines).startswith(first_line)

            # the one row was taken by the abandoned stream; the next request is served only if it was freed
            def freed() -> bool:
                metrics = httpx.get(f"{live.url}/metrics").text
                return not scheduler.running and "engine_requests_running 0.0" in metrics

            deadline = time.monotonic() + 10
            while not freed() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert freed()
            assert live.engine.engine.executor.cache.resident_bytes() == 0  # its pages are handed back
            assert chat(live, max_tokens=3).choices[0].finish_reason in ("length", "stop")
            metrics = httpx.get(f"{live.url}/metrics").text
            assert f'engine_requests_finished_total{{finish_reason="abort"}} {aborted}.0' in metrics
    finally:
        live.stop()


def test_prefix_caching_reports_cached_prompt_tokens_in_usage_and_metrics(engine_factory):
    live = LiveServer(engine_factory("gqa"), enable_prefix_caching=True)
    try:
        messages = [{"role": "user", "content": "hello there, how are you today?"}]
        first = live.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "more"},
        ]
        second = live.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.0)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert first.usage.prompt_tokens < cached < second.usage.prompt_tokens  # the first turn, not the new message
        assert f"engine_prefix_cache_hit_tokens_total {float(cached)}" in httpx.get(f"{live.url}/metrics").text
        salted = live.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0.0, extra_body={"cache_salt": "another tenant"}
        )
        assert salted.usage.prompt_tokens_details.cached_tokens == 0  # K/V computed for unsalted requests: not its
        # the answer from the cached prefix is the one computed from scratch
        assert second.choices[0].message.content == salted.choices[0].message.content
    finally:
        live.stop()


def test_an_api_key_guards_every_route_but_health_and_metrics(engine_factory):
    """And browsers: an allowed origin's preflight is answered (without the key, which browsers do not send on
    one), other origins get no CORS grant."""
    live = LiveServer(engine_factory("gqa"), api_key="s3cret", allowed_origins=["http://ui.example"])
    try:
        preflight = {
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        }
        allowed = httpx.options(f"{live.url}/v1/chat/completions", headers={"Origin": "http://ui.example", **preflight})
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "http://ui.example"
        other = httpx.options(f"{live.url}/v1/chat/completions", headers={"Origin": "http://evil.example", **preflight})
        assert "access-control-allow-origin" not in other.headers
        keyed = httpx.get(
            f"{live.url}/v1/models", headers={"Origin": "http://ui.example", "Authorization": "Bearer s3cret"}
        )
        assert keyed.status_code == 200 and keyed.headers["access-control-allow-origin"] == "http://ui.example"
        assert chat(live).choices[0].message.content is not None  # the client sends it
        wrong = openai.OpenAI(base_url=f"{live.url}/v1", api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="API key"):
            wrong.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert httpx.get(f"{live.url}/v1/models").status_code == 401
        assert httpx.post(f"{live.url}/tokenize", json={"model": MODEL, "prompt": "x"}).status_code == 401
        assert (
            httpx.get(f"{live.url}/health").status_code == 200 and httpx.get(f"{live.url}/metrics").status_code == 200
        )
    finally:
        live.stop()


def test_a_full_queue_answers_503(engine_factory):
    live = LiveServer(engine_factory("gqa"), max_batch=1, max_waiting=0)
    llm = live.engine.engine
    fast_step = llm.step
    llm.step = lambda: (time.sleep(0.02), fast_step())[1]  # a slow model: the first request holds its row for 3 s
    try:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 150, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body) as response:
            lines = response.iter_lines()  # kept referenced: a discarded iterator closes the connection
            next(lines)  # it holds the only row
            rejected = httpx.post(f"{live.url}/v1/completions", json={**body, "stream": False})
            assert rejected.status_code == 503 and rejected.json()["error"]["type"] == "server_overloaded", (
                rejected.text
            )
    finally:
        live.stop()


def test_async_engine_refuses_when_full(engine_factory):
    import asyncio

    engine = AsyncEngine(LLMEngine(EngineArgs(engine_factory("gqa"), max_batch=1)), max_waiting=0)
    llm = engine.engine
    from runner.sampling.params import SamplingParams

    async def scenario():
        params = SamplingParams(max_tokens=100, ignore_eos=True)
        first = engine.generate([llm.new_request("hello", None, params)])
        await first.__anext__()
        with pytest.raises(EngineOverloaded):
            await engine.generate([llm.new_request("hello", None, params)]).__anext__()
        await first.aclose()

    asyncio.run(scenario())
    engine.shutdown(grace_seconds=1)


def test_shutdown_lets_running_streams_finish_and_refuses_new_ones(engine_factory):
    live = LiveServer(engine_factory("gqa"), max_batch=2)
    llm = live.engine.engine
    fast_step = llm.step
    llm.step = lambda: (time.sleep(0.02), fast_step())[1]
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 40, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        stopper = threading.Thread(target=live.stop)
        stopper.start()
        rest = [line for line in lines if line]
    stopper.join(timeout=30)
    assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]
    assert not live.thread.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{live.url}/health")


def test_a_speculative_engine_serves_the_same_streams_and_reports_acceptance(server, engine_factory, tiny_draft_head):
    """Several tokens per step come out as several stream chunks, with the plain engine's text; /metrics reports
    the verify steps and tokens per step."""
    live = LiveServer(engine_factory("gqa", draft_head=tiny_draft_head[0]), speculative_max_rows=None)
    try:
        prompts = ["hello world", "The quick brown fox", "Engines compile graphs"]
        for prompt in prompts:
            expected = chat(server, prompt, max_tokens=24).choices[0].message.content
            stream = chat(live, prompt, max_tokens=24, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
        metrics = httpx.get(f"{live.url}/metrics").text
        assert "engine_speculative_verify_steps" in metrics and "engine_speculative_tokens_per_step" in metrics
        steps = float(
            next(
                line.split()[1] for line in metrics.splitlines() if line.startswith("engine_speculative_verify_steps ")
            )
        )
        assert steps > 0
    finally:
        live.stop()
