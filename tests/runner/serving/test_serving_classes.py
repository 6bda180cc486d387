"""The serving classes without HTTP: a body in, a response object or the SSE lines out, as the routers use them."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from runner.core.args import EngineArgs
from runner.core.async_engine import AsyncEngine
from runner.core.engine import LLMEngine
from runner.serving.protocol import APIError, ChatBody, CompletionBody, TokenizeBody
from runner.serving.serving_chat import ServingChat
from runner.serving.serving_completions import ServingCompletions
from runner.serving.serving_tokenization import ServingTokenization

MODEL = "tiny"


async def connected() -> bool:
    return False


async def left() -> bool:
    return True


@pytest.fixture(scope="module")
def engine(engine_factory):
    async_engine = AsyncEngine(LLMEngine(EngineArgs(engine_factory("gqa"), max_batch=2)))
    yield async_engine
    async_engine.shutdown(0)


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_chat_answer_and_its_stream_say_the_same(engine):
    chat = ServingChat(engine, MODEL)
    fields = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "temperature": 0}
    answer = run(chat.create(ChatBody(**fields), connected))
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] == 8
    text = answer["choices"][0]["message"]["content"]

    async def stream() -> list[str]:
        lines = await chat.create(ChatBody(**fields, stream=True), connected)
        return [line async for line in lines]

    lines = run(stream())
    assert lines[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text


def test_completions_and_tokenization_without_http(engine):
    completions = ServingCompletions(engine, MODEL)
    answer = run(completions.create(CompletionBody(model=MODEL, prompt=["hi", "there"], max_tokens=3), connected))
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert answer["usage"]["completion_tokens"] == 6
    tokens = ServingTokenization(engine, MODEL).tokenize(TokenizeBody(model=MODEL, prompt="hello world"))
    assert tokens["count"] == len(tokens["tokens"]) > 0


def test_errors_are_api_errors_and_a_client_that_left_gets_nothing(engine):
    chat = ServingChat(engine, MODEL)
    with pytest.raises(APIError, match="does not exist") as missing:
        run(chat.create(ChatBody(model="other", messages=[{"role": "user", "content": "hi"}]), connected))
    assert missing.value.status == 404 and missing.value.param == "model"
    with pytest.raises(APIError, match="temperature") as invalid:
        run(chat.create(ChatBody(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-1), connected))
    assert invalid.value.status == 400
    body = ChatBody(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=200, ignore_eos=True)
    assert run(chat.create(body, left)) is None  # the route answers 499; generation stopped
    deadline = time.monotonic() + 5  # (the abort reaches the engine's loop thread through its command queue)
    while engine.engine.scheduler.running:
        assert time.monotonic() < deadline, "the request of a client that left still runs"
        time.sleep(0.01)
