"""OpenAI's Responses API, `POST /v1/responses` and the stored responses' routes, answered by the chat machinery:
input items become chat turns (runner/serving/responses.py), the answer becomes output items and, streamed, the API's
typed events."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from runner.core.request import Request as EngineRequest
from runner.sampling.logprobs import TokenLogprob
from runner.sampling.params import SamplingParams
from runner.serving.generation import Disconnected, engine_error, first_event, run_to_end, token_events
from runner.serving.protocol import UNSUPPORTED_RESPONSES_FIELDS, APIError, ResponsesBody
from runner.serving.request_params import sampling_params
from runner.serving.responses import (
    LOGPROBS_INCLUDE,
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
from runner.serving.responses import usage as responses_usage
from runner.serving.serving_base import ServingContext
from runner.serving.tool_calls import ToolRequestError, forced_tools


@dataclass
class ResponseRun:
    """One response being answered: its request, the conversation it continues and the turns it adds, its fields
    known before the answer (`head`), the output items as they form."""

    body: ResponsesBody
    request: EngineRequest
    earlier: list[dict]
    added: list[dict]
    head: dict
    output: ResponseOutput
    top_logprobs: int | None  # None: logprobs not asked for

    def logprobs(self, codec, start: int) -> list[dict]:
        if self.top_logprobs is None:
            return []
        return responses_logprobs(codec, self.request.logprobs[start:], self.top_logprobs)

    def finished(self) -> dict:
        request, complete = self.request, self.request.finish_reason != "length"
        return {
            **self.head,
            "status": "completed" if complete else "incomplete",
            "output": self.output.items,
            "incomplete_details": None if complete else {"reason": "max_output_tokens"},
            "usage": responses_usage(
                len(request.prompt_token_ids), len(request.output_token_ids), request.num_cached_tokens
            ),
        }


class ServingResponses(ServingContext):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stored = ResponseStore()

    async def create(self, body: ResponsesBody, disconnected: Disconnected) -> dict | AsyncIterator[str] | None:
        """A response object, an SSE stream of the API's events, or None when the client left first."""
        run = await self._start(body)
        if body.stream:
            return await self._stream(run)
        if not await run_to_end(self.engine, disconnected, [[run.request]]):
            return None
        run.output.feed(run.request.text, run.logprobs(self.codec, 0))
        run.output.finish(run.request.text, run.request.finish_reason)
        return self._store(run)

    async def _start(self, body: ResponsesBody) -> ResponseRun:
        self.check_model(body.model)
        self.check_size(body)
        refuse_unsupported_responses(body)
        include = body.include or []
        top_logprobs = (body.top_logprobs or 0) if LOGPROBS_INCLUDE in include else None
        try:
            earlier = (
                [] if body.previous_response_id is None else self.stored.get(body.previous_response_id).conversation
            )
            turns, added = chat_turns(body.input, body.instructions, earlier)
            tools_asked, tool_choice = chat_tools(body.tools), chat_tool_choice(body.tool_choice)
            if body.text is not None and body.response_format is not None:
                raise ResponsesError("give text.format, not response_format", "response_format")
            body.response_format = response_format(body.text) if body.text is not None else body.response_format
            tools = forced_tools(tools_asked, tool_choice, body.parallel_tool_calls, auto=self.parser is not None)
        except ResponsesError as err:
            raise responses_api_error(err) from None
        except ToolRequestError as err:
            raise APIError(400, str(err), param=err.field) from None
        auto = self.auto_tool_parser(tools_asked, tool_choice)
        limit = next((v for v in (body.max_output_tokens, body.max_tokens) if v is not None), self.default_limit)
        params = sampling_params(body, limit, top_logprobs, self.defaults, tools=tools)

        def requests():
            text, ids = self.render_chat(turns, "input", body.add_special_tokens, tools=tools_asked)
            return [self.make_requests(text, ids, params, body)]

        groups = await self.prepare(params, requests)
        head = response_head(body, params)
        return ResponseRun(body, groups[0][0], earlier, added, head, ResponseOutput(tools, auto), top_logprobs)

    def _store(self, run: ResponseRun) -> dict:
        response = run.finished()
        if run.body.store:
            conversation = run.earlier + run.added + output_turns(run.output.items)
            self.stored.put(response, conversation, input_items(run.body.input))
        return response

    async def _stream(self, run: ResponseRun) -> AsyncIterator[str]:
        events = token_events(self.engine, [[run.request]])
        opening = await first_event(events)  # before the 200, so that capacity errors are still HTTP errors
        output = run.output

        def frame(event: dict) -> str:
            return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

        async def sse() -> AsyncIterator[str]:
            yield frame(output.event("response.created", response=run.head))
            yield frame(output.event("response.in_progress", response=run.head))
            logprobs_sent = 0
            try:
                event = opening
                while event is not None:
                    new_logprobs = run.logprobs(self.codec, logprobs_sent)
                    logprobs_sent += len(new_logprobs)
                    for piece in output.feed(event.delta, new_logprobs):
                        yield frame(piece)
                    event = await anext(events, None)
                for piece in output.finish(run.request.text, run.request.finish_reason):
                    yield frame(piece)
                response = self._store(run)
                yield frame(output.event(f"response.{response['status']}", response=response))
            except Exception as err:  # after the 200: the response fails in-band, as OpenAI reports it
                error = engine_error(err)
                failed = {
                    **run.head,
                    "status": "failed",
                    "output": output.items,
                    "error": {"code": error.kind, "message": error.message},
                }
                yield frame(output.event("response.failed", response=failed))
            finally:
                await events.aclose()

        return sse()

    def get(self, response_id: str) -> dict:
        try:
            return self.stored.get(response_id).response
        except ResponsesError as err:
            raise responses_api_error(err) from None

    def input_items(self, response_id: str, order: str, limit: int, after: str | None, before: str | None) -> dict:
        """A stored response's own input items (client.responses.input_items.list)."""
        if not 1 <= limit <= 100:
            raise APIError(400, "limit must be in [1, 100]", param="limit")
        try:
            return page(self.stored.get(response_id).input_items, order, limit, after, before)
        except ResponsesError as err:
            raise responses_api_error(err) from None

    def delete(self, response_id: str) -> dict:
        try:
            self.stored.delete(response_id)
        except ResponsesError as err:
            raise responses_api_error(err) from None
        return {"id": response_id, "object": "response", "deleted": True}


def refuse_unsupported_responses(body: ResponsesBody) -> None:
    extra = body.model_extra or {}
    for name, asks_nothing in UNSUPPORTED_RESPONSES_FIELDS.items():
        if name in extra and not asks_nothing(extra[name]):
            raise APIError(400, f"{name} is not supported by this server", param=name)
    if body.n != 1:
        raise APIError(400, "a response is one answer: n is not part of the Responses API", param="n")
    if set(body.include or []) - {LOGPROBS_INCLUDE}:
        raise APIError(400, f"include supports {LOGPROBS_INCLUDE!r} only", param="include")
    if body.top_logprobs is not None and LOGPROBS_INCLUDE not in (body.include or []):
        raise APIError(400, f"top_logprobs come with include [{LOGPROBS_INCLUDE!r}]", param="top_logprobs")
    if body.max_output_tokens == 0:
        raise APIError(400, "max_output_tokens must be >= 1", param="max_output_tokens")


def responses_api_error(err: ResponsesError) -> APIError:
    return APIError(
        err.status, str(err), "not_found_error" if err.status == 404 else "invalid_request_error", err.param
    )


def response_head(body: ResponsesBody, params: SamplingParams) -> dict:
    """A response's fields that do not depend on its answer (as in response.created); temperature and top_p as
    sampled (the model's recommended values where the request set none)."""
    return {
        "id": f"resp_{body.request_id or uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "model": body.model,
        "status": "in_progress",
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": None,
        "store": body.store,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_logprobs": body.top_logprobs,
        "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "truncation": body.truncation,
        "user": body.user,
        "usage": None,
    }


def responses_logprobs(codec, logprobs: list[TokenLogprob], top: int) -> list[dict]:
    """The Responses API's logprobs: each token's text, its UTF-8 bytes, its logprob and the `top` likeliest."""

    def entry(token: int, logprob: float) -> dict:
        text = codec.decode([token])
        return {"token": text, "bytes": list(text.encode()), "logprob": logprob}

    return [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top[:top]]} for lp in logprobs
    ]
