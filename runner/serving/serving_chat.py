"""OpenAI's chat completions API, `POST /v1/chat/completions`: chat messages through the engine's template, tools
(forced by tool_choice, or read from the model's own syntax where it decides), vLLM's chat extras, streamed or not."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator

from runner.core.engine import TokenEvent
from runner.core.request import Request as EngineRequest
from runner.serving.generation import Disconnected
from runner.serving.protocol import APIError, ChatBody
from runner.serving.request_params import message_text, sampling_params
from runner.serving.serving_base import ServingContext, logprobs_content
from runner.serving.tool_calls import ForcedTools, ToolRequestError, forced_tools, tool_call
from runner.serving.tool_parsers import AutoToolStream, ParsedCalls, ToolCallParser


class ServingChat(ServingContext):
    async def create(self, body: ChatBody, disconnected: Disconnected) -> dict | AsyncIterator[str] | None:
        """A response object, an SSE stream, or None when the client left (ServingContext.respond)."""
        self.check_model(body.model)
        self.check_size(body)
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        limit = next((v for v in (body.max_completion_tokens, body.max_tokens) if v is not None), self.default_limit)
        if limit == 0:
            raise APIError(400, "max_tokens must be >= 1", param="max_tokens")
        try:
            tools = forced_tools(body.tools, body.tool_choice, body.parallel_tool_calls, auto=self.parser is not None)
        except ToolRequestError as err:
            raise APIError(400, str(err), param=err.field) from None
        auto = self.auto_tool_parser(body.tools, body.tool_choice)
        # vLLM's echo: an answer that goes on with a final assistant message (continue_final_message) starts with it
        last = body.messages[-1]
        echo = message_text(last.content) if body.echo and last.role == "assistant" else ""
        if echo and (tools is not None or auto is not None):
            raise APIError(400, "echo cannot be combined with tool calls", param="echo")
        params = sampling_params(body, limit, logprobs, self.defaults, tools=tools)

        def requests():
            text, ids = self.chat_prompt(body, tools=body.tools, documents=body.documents)
            return [self.make_requests(text, ids, params, body)]

        groups = await self.prepare(params, requests)
        as_ids = body.return_tokens_as_token_ids
        choice = functools.partial(chat_choice, tools=tools, echo=echo, as_ids=as_ids, parser=auto)
        chunk = functools.partial(
            chat_chunk, tools=tools, echo=echo, as_ids=as_ids, auto=None if auto is None else AutoToolStream(auto)
        )
        return await self.respond(disconnected, body, groups, "chat.completion", choice, chunk)


def chat_choice(
    codec,
    index: int,
    request: EngineRequest,
    tools: ForcedTools | None = None,
    echo: str = "",
    as_ids: bool = False,
    parser: ToolCallParser | None = None,
) -> dict:
    message, finish_reason = {"role": "assistant", "content": echo + request.text}, request.finish_reason
    calls = tools.tool_calls(request.text) if tools is not None and finish_reason == "stop" else None
    if calls:  # (an answer cut by max_tokens is no call: it stays text, finish_reason "length")
        message = {"role": "assistant", "content": None, "tool_calls": calls}
        finish_reason = tool_finish_reason(tools)
    parsed = auto_calls(parser, request.text, finish_reason)
    if parsed.calls:  # calls the model made by itself (tool_choice "auto"), after the text before them, if any
        message = {
            "role": "assistant",
            "content": request.text[: parsed.content_end].strip() or None,
            "tool_calls": [tool_call(name, arguments) for name, arguments in parsed.calls],
        }
        finish_reason = "tool_calls"
    choice = {
        "index": index,
        "message": message,
        "finish_reason": finish_reason,
        "stop_reason": request.stop_reason,
        "logprobs": None,
    }
    if request.params.logprobs is not None:
        choice["logprobs"] = {"content": logprobs_content(codec, request.logprobs, as_ids=as_ids)}
    return choice


def tool_finish_reason(tools: ForcedTools) -> str:
    return "stop" if tools.name is not None else "tool_calls"  # OpenAI's and vLLM's for a named function; vLLM's


def auto_calls(parser: ToolCallParser | None, text: str, finish_reason: str | None) -> ParsedCalls:
    """The calls a finished answer makes in the model's own syntax (none without a parser, or when it was cut)."""
    if parser is None or finish_reason != "stop":
        return ParsedCalls(len(text), [])
    return parser.parse(text)


def chat_chunk(
    codec,
    index: int,
    event: TokenEvent,
    first: bool,
    logprob_from: int,
    tools: ForcedTools | None = None,
    echo: str = "",
    as_ids: bool = False,
    auto: AutoToolStream | None = None,
) -> dict | None:
    """A stream's chunk for `event`, or None when there is nothing to send yet."""
    request = event.request
    finish_reason = request.finish_reason if event.finished else None
    if auto is not None:  # content while it surely is content; calls, whole, at the end
        rid = request.request_id
        text, content = auto.push(rid, event.delta)
        parsed = auto_calls(auto.parser, text, finish_reason) if event.finished else None
        if parsed is not None:
            content += auto.rest(rid, parsed.content_end)
        if not content and parsed is None:
            return None
        delta = {"content": content} if rid in auto.text_started else {"role": "assistant", "content": content}
        auto.text_started.add(rid)
        if parsed is not None and parsed.calls:
            delta["tool_calls"] = [
                {"index": i, **tool_call(name, arguments)} for i, (name, arguments) in enumerate(parsed.calls)
            ]
            finish_reason = "tool_calls"
    elif tools is None:
        delta = {"role": "assistant", "content": echo + event.delta} if first else {"content": event.delta}
    elif tools.name is not None:  # one call: its arguments stream as they come
        call = (
            {"index": 0, **tool_call(tools.name, event.delta)}
            if first
            else {"index": 0, "function": {"arguments": event.delta}}
        )
        delta = {"role": "assistant", "tool_calls": [call]} if first else {"tool_calls": [call]}
    else:  # a list of calls: known when it is complete
        if not event.finished:
            return None
        calls = tools.tool_calls(request.text) if finish_reason == "stop" else None
        delta = (
            {"role": "assistant", "tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
            if calls
            else {"role": "assistant", "content": request.text}
        )
        finish_reason = tool_finish_reason(tools) if calls else finish_reason
    chunk = {
        "index": index,
        "delta": delta,
        "finish_reason": finish_reason,
        "stop_reason": request.stop_reason if event.finished else None,
        "logprobs": None,
    }
    if event.request.params.logprobs is not None:
        chunk["logprobs"] = {"content": logprobs_content(codec, event.request.logprobs[logprob_from:], as_ids=as_ids)}
    return chunk
