"""OpenAI-compatible HTTP API over an AsyncEngine: /v1/models, /v1/completions, /v1/chat/completions, /v1/responses
(JSON or Server-Sent Events), /health and /metrics. Errors are OpenAI error objects with a 4xx/5xx status; a request that
fails never disturbs the others."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic import BaseModel, ConfigDict, Field, model_validator

from runner.async_engine import AsyncEngine, EngineOverloaded, EngineStopped
from runner.llm_engine import PromptError, TokenEvent
from runner.request import Request as EngineRequest
from runner.request import TokenLogprob
from runner.responses import (LOGPROBS_INCLUDE, ResponseOutput, ResponsesError, ResponseStore, chat_tool_choice,
                              chat_tools, chat_turns, input_items, output_turns, page, response_format)
from runner.responses import usage as responses_usage
from runner.sampling import SamplingParams
from runner.structured import GrammarError, StructuredOutputs
from runner.tool_calls import ForcedTools, ToolRequestError, forced_tools, tool_call
from runner.tool_parsers import PARSERS, AutoToolStream, ParsedCalls, ToolCallParser


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_response(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status)


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk too (with include_usage)


# OpenAI fields this server does not implement, each with the test of a value that asks for nothing (clients send
# some of them by default): any other value gets a 400 naming the field rather than an answer that silently ignores
# it. Fields unknown to OpenAI too are ignored, as vLLM does.
UNSUPPORTED_FIELDS = {
    "suffix": lambda value: not value,
    "functions": lambda value: not value,
    "function_call": lambda value: value in (None, "none", "auto"),
    "prediction": lambda value: value is None,
    "audio": lambda value: value is None,
    "modalities": lambda value: value in (None, ["text"]),
    # vLLM's extras that this server does not implement (its others are implemented, see SamplingFields)
    "guided_grammar": lambda value: value is None,
    "guided_decoding_backend": lambda value: value is None,
    "guided_whitespace_pattern": lambda value: value is None,
    "use_beam_search": lambda value: not value,
    "length_penalty": lambda value: value == 1.0,
    "priority": lambda value: value == 0,
    "chat_template": lambda value: value is None,  # a template from the request: vLLM refuses it by default too
    "logits_processors": lambda value: not value,
    "prompt_embeds": lambda value: value is None,
    "mm_processor_kwargs": lambda value: not value,
    "kv_transfer_params": lambda value: value is None,
    "vllm_xargs": lambda value: not value,
}


class SamplingFields(BaseModel):
    """The sampling fields both endpoints share (OpenAI's names, plus vLLM's extras)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        # OpenAI reads null as "not given" for every optional parameter, and some clients send nulls for all of them
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob, rank and the top ones (not streamed)
    response_format: dict[str, Any] | None = None  # OpenAI's: text, json_object or json_schema
    guided_json: dict[str, Any] | str | None = None  # vLLM's structured outputs, older and newer names
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's extras from here on
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool | None = None  # None: the endpoint's default (completions add BOS, chat does not)
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>"
    request_id: str | None = None  # the response's id (after its "cmpl-" / "chatcmpl-")
    cache_salt: str | None = None  # prefix caching shares cached K/V only between requests with the same salt
    user: str | None = None


class CompletionBody(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class TokenizeBody(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages to which the chat template is applied first."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None  # None: as the completions (prompt) or chat (messages) endpoint would


class DetokenizeBody(BaseModel):
    model: str
    tokens: list[int]


class ChatBody(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None  # called when tool_choice forces them (runner/tool_calls.py)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    echo: bool = False  # vLLM's: an answer to a final assistant message starts with that message's content
    add_generation_prompt: bool = True  # vLLM's chat-template controls from here on
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None


class ResponsesBody(SamplingFields):
    """OpenAI's Responses API request (runner/responses.py), with the sampling extras the other endpoints take."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: Literal["disabled"] = "disabled"  # "auto" (drop the oldest turns to fit) is not implemented


# Responses API fields this server does not implement, each with the test of a value that asks for nothing
UNSUPPORTED_RESPONSES_FIELDS = {
    "background": lambda value: not value,
    "conversation": lambda value: value is None,
    "prompt": lambda value: value is None,  # stored prompt templates
    "reasoning": lambda value: not value or (isinstance(value, dict) and not any(value.values())),  # no reasoning models
    "max_tool_calls": lambda value: value is None,
}


def _refuse_unsupported(body: SamplingFields) -> None:
    extra = body.model_extra or {}
    for name, asks_nothing in UNSUPPORTED_FIELDS.items():
        if name in extra and not asks_nothing(extra[name]):
            raise APIError(400, f"{name} is not supported by this server", param=name)
    best_of = extra.get("best_of")
    if best_of is not None and best_of not in (1, body.n):  # best_of = n returns all it generates: plain n
        raise APIError(400, "best_of other than n is not supported by this server", param="best_of")


# the fields a model's generation config gives defaults for (vLLM's --generation-config auto), max_tokens aside
MODEL_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _sampling(body: SamplingFields, max_tokens: int | None, logprobs: int | None, defaults: dict[str, Any],
              echo_logprobs: int | None = None, tools: ForcedTools | None = None) -> SamplingParams:
    """`defaults`: the model's recommended sampling, for the fields the body leaves unset (max_tokens: for a None
    `max_tokens`); `echo_logprobs`: how many top prompt logprobs the completions API's echo shows (None: no echo);
    `tools`: the tool calls the answer must be."""
    _refuse_unsupported(body)
    structured = _structured_outputs(body)
    if tools is not None:
        if structured is not None:
            raise APIError(400, "a forced tool call is a structured output already: drop response_format / guided_*",
                           param="tool_choice")
        structured = StructuredOutputs(json=tools.output_schema())
    if body.prompt_logprobs is not None and body.stream:
        raise APIError(400, "prompt_logprobs are not available when streaming", param="prompt_logprobs")
    wanted = [k for k in (body.prompt_logprobs, echo_logprobs) if isinstance(k, int)]
    prompt_logprobs = max(wanted) if wanted else body.prompt_logprobs  # a bad value is SamplingParams' to refuse
    defaulted = {name: getattr(body, name) if name in body.model_fields_set else defaults.get(name, getattr(body, name))
                 for name in MODEL_DEFAULTED}
    try:
        return SamplingParams(
            **defaulted, structured_outputs=structured,
            max_tokens=max_tokens if max_tokens is not None else defaults.get("max_tokens", 16), n=body.n,
            seed=body.seed, stop=body.stop or [], stop_token_ids=body.stop_token_ids or [],
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, logit_bias=body.logit_bias or {},
            allowed_token_ids=body.allowed_token_ids, bad_words=body.bad_words or [],
            include_stop_str_in_output=body.include_stop_str_in_output, skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
        )
    except ValueError as err:
        raise APIError(400, str(err)) from None


def _structured_outputs(body: SamplingFields) -> StructuredOutputs | None:
    """OpenAI's response_format, or vLLM's guided_json / guided_regex / guided_choice / structured_outputs."""
    asked = []
    response_format = body.response_format or {"type": "text"}
    kind = response_format.get("type")
    if kind == "json_object":
        asked.append(StructuredOutputs(json_object=True))
    elif kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if schema is None:
            raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
        asked.append(StructuredOutputs(json=schema))
    elif kind != "text":
        raise APIError(400, f"response_format type {kind!r} is not one of text, json_object, json_schema",
                       param="response_format")
    for value, make in ((body.guided_json, lambda v: StructuredOutputs(json=v)),
                        (body.guided_regex, lambda v: StructuredOutputs(regex=v)),
                        (body.guided_choice, lambda v: StructuredOutputs(choice=v)),
                        (body.structured_outputs, _vllm_structured_outputs)):
        if value is not None:
            asked.append(make(value))
    if len(asked) > 1:
        raise APIError(400, "ask for one structured output (response_format, guided_* or structured_outputs)",
                       param="response_format")
    return asked[0] if asked else None


def _vllm_structured_outputs(fields: dict[str, Any]) -> StructuredOutputs:
    known = {"json", "json_object", "regex", "choice"}
    if not set(fields) <= known:
        raise APIError(400, f"structured_outputs supports {', '.join(sorted(known))}; not {', '.join(sorted(set(fields) - known))}",
                       param="structured_outputs")
    return StructuredOutputs(**fields)


def _message_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise APIError(400, f"unsupported content part type {part.get('type')!r}: this model reads text only", param="messages")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


OPEN_PATHS = ("/health", "/metrics", "/version")  # probes and scrapers need no API key


def create_app(engine: AsyncEngine, model_name: str, shutdown_grace: float = 10.0, api_key: str | None = None,
               tool_call_parser: str | None = None, allowed_origins: list[str] | None = None) -> FastAPI:
    """`api_key`: when set, every route but OPEN_PATHS wants `Authorization: Bearer <api_key>` (401 otherwise).
    `tool_call_parser` (a name in runner/tool_parsers.PARSERS): read the calls the model makes by itself, which
    serves tool_choice "auto". `allowed_origins`: the browser origins (CORS) that may call the API ("*": any)."""
    parser = None if tool_call_parser is None else PARSERS[tool_call_parser]
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        # on shutdown: no new requests, running ones get `shutdown_grace` seconds, then are aborted
        await asyncio.to_thread(engine.shutdown, shutdown_grace)

    app = FastAPI(title="llm-engine-builder runner", version="0.1.0", lifespan=lifespan)
    llm = engine.engine
    created = int(time.time())
    defaults = llm.sampling_defaults  # the model's recommended sampling, for what a request leaves unset
    # a chat answer without a limit may use the rest of the context (OpenAI's and vLLM's default), or the model's own
    default_limit = defaults.get("max_tokens", llm.max_seq_len)

    if api_key is not None:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def check_api_key(http: Request, call_next):
            given = http.headers.get("authorization", "").encode()
            if http.url.path not in OPEN_PATHS and not hmac.compare_digest(given, expected):
                return error_response(401, "invalid or missing API key (Authorization: Bearer ...)", "invalid_request_error")
            return await call_next(http)

    if allowed_origins:  # added last, so outermost: a browser's preflight is answered before the API key check
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"])

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return error_response(err.status, err.message, err.kind, err.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON body: {first.get('ctx', {}).get('error', 'invalid')}", "invalid_request_error")
        return error_response(400, f"{where}: {first.get('msg', 'invalid')}", "invalid_request_error", where or None)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(model_name), media_type="text/plain; version=0.0.4")

    model_card = {"id": model_name, "object": "model", "created": created, "owned_by": "local", "max_model_len": llm.max_seq_len}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict:
        """OpenAI's retrieve-a-model (client.models.retrieve)."""
        if name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}", "not_found_error", "model")
        return model_card

    @app.get("/version")
    async def version() -> dict:
        return {"version": app.version}

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        """Unknown routes and methods get OpenAI error objects too (not FastAPI's {"detail": ...})."""
        return error_response(err.status_code, f"{err.detail}", "invalid_request_error" if err.status_code < 500 else "server_error")

    def check_model(body: BaseModel) -> None:
        if body.model != model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}", "not_found_error", "model")

    def make_requests(prompt: str | None, ids: list[int] | None, params: SamplingParams,
                      body: SamplingFields) -> list[EngineRequest]:
        """A text prompt is tokenized here, with or without the BOS token as the body asks (the completions
        endpoint's default adds it, the chat endpoint's, whose template writes it, does not: vLLM's defaults)."""
        if ids is None and isinstance(prompt, str):
            chat_like = not isinstance(body, CompletionBody)
            ids = llm.codec.encode(prompt, add_special_tokens=_adds_bos(body.add_special_tokens, chat_like))
        try:
            return llm.new_requests(prompt, ids, params, cache_salt=body.cache_salt)
        except PromptError as err:
            raise APIError(400, str(err), param="prompt") from None
        except GrammarError as err:
            raise APIError(400, str(err), param="response_format") from None

    def chat_prompt(body: ChatBody | TokenizeBody, tools: list | None = None, documents: list | None = None) -> str:
        # a message's other fields (an assistant's tool_calls, a tool result's tool_call_id) go to the template too
        turns = [{**(m.model_extra or {}), "role": m.role, "content": _message_text(m.content)} for m in body.messages]
        return apply_template(turns, "messages", add_generation_prompt=body.add_generation_prompt, tools=tools,
                              documents=documents, continue_final_message=body.continue_final_message,
                              template_kwargs=body.chat_template_kwargs)

    def apply_template(turns: list[dict], param: str, **options) -> str:
        try:
            return llm.codec.apply_chat_template(turns, **options)
        except Exception as err:  # ChatTemplateError, or anything else a jinja template raises
            raise APIError(400, f"cannot apply the chat template: {err}", param=param) from None

    def auto_tool_parser(tools: list | None, tool_choice) -> ToolCallParser | None:
        """The parser that reads the model's own calls where the model decides (tool_choice "auto")."""
        if parser is None or not tools or tool_choice not in (None, "auto"):
            return None
        if "tools" not in (llm.codec.info.chat_template or ""):
            raise APIError(400, "this engine's chat template does not show tools to the model, so it cannot decide to "
                           "call one: use tool_choice \"required\" or a named function", param="tool_choice")
        return parser

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody) -> dict:
        """The token ids a prompt (or a chat) becomes, so a client can count them before sending (vLLM's endpoint)."""
        check_model(body)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        text = body.prompt if body.messages is None else chat_prompt(body)
        tokens = llm.codec.encode(text, add_special_tokens=_adds_bos(body.add_special_tokens, body.messages is not None))
        return {"count": len(tokens), "max_model_len": llm.max_seq_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody) -> dict:
        check_model(body)
        vocab = llm.manifest.model.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": llm.codec.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: Request):
        check_model(body)
        # echo returns the prompt before the completion, with its tokens' logprobs when logprobs are asked for;
        # max_tokens 0 with echo returns the prompt alone (OpenAI's legacy way to score a text)
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens must be >= 1 (0 only with echo: the prompt alone)", param="max_tokens")
        params = _sampling(body, body.max_tokens, body.logprobs, defaults, body.logprobs if body.echo else None)
        prompts = _completion_prompts(body.prompt)
        # off the event loop: a first structured-output request imports xgrammar (~1.5 s, torch and transformers)
        groups = await asyncio.to_thread(lambda: [make_requests(text, ids, params, body) for text, ids in prompts])
        as_ids = body.return_tokens_as_token_ids
        choice = functools.partial(_completion_choice, echo=body.echo, prompt_logprobs=body.prompt_logprobs, as_ids=as_ids)
        chunk = functools.partial(_completion_chunk, echo=body.echo, as_ids=as_ids)
        return await _respond(engine, http, body, groups, "text_completion", choice, chunk)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, http: Request):
        check_model(body)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        limit = next((v for v in (body.max_completion_tokens, body.max_tokens) if v is not None), default_limit)
        if limit == 0:
            raise APIError(400, "max_tokens must be >= 1", param="max_tokens")
        try:
            tools = forced_tools(body.tools, body.tool_choice, body.parallel_tool_calls, auto=parser is not None)
        except ToolRequestError as err:
            raise APIError(400, str(err), param=err.field) from None
        auto = auto_tool_parser(body.tools, body.tool_choice)
        # vLLM's echo: an answer that goes on with a final assistant message (continue_final_message) starts with it
        last = body.messages[-1]
        echo = _message_text(last.content) if body.echo and last.role == "assistant" else ""
        if echo and (tools is not None or auto is not None):
            raise APIError(400, "echo cannot be combined with tool calls", param="echo")
        params = _sampling(body, limit, logprobs, defaults, tools=tools)
        groups = await asyncio.to_thread(
            lambda: [make_requests(chat_prompt(body, tools=body.tools, documents=body.documents), None, params, body)])
        as_ids = body.return_tokens_as_token_ids
        choice = functools.partial(_chat_choice, tools=tools, echo=echo, as_ids=as_ids, parser=auto)
        chunk = functools.partial(_chat_chunk, tools=tools, echo=echo, as_ids=as_ids,
                                  auto=None if auto is None else AutoToolStream(auto))
        return await _respond(engine, http, body, groups, "chat.completion", choice, chunk)

    stored = ResponseStore()

    @app.post("/v1/responses")
    async def create_response(body: ResponsesBody, http: Request):
        """OpenAI's Responses API (runner/responses.py), answered like a chat."""
        check_model(body)
        _refuse_unsupported_responses(body)
        include = body.include or []
        logprobs = (body.top_logprobs or 0) if LOGPROBS_INCLUDE in include else None
        try:
            earlier = [] if body.previous_response_id is None else stored.get(body.previous_response_id).conversation
            turns, added = chat_turns(body.input, body.instructions, earlier)
            tools_asked, tool_choice = chat_tools(body.tools), chat_tool_choice(body.tool_choice)
            if body.text is not None and body.response_format is not None:
                raise ResponsesError("give text.format, not response_format", "response_format")
            body.response_format = response_format(body.text) if body.text is not None else body.response_format
            tools = forced_tools(tools_asked, tool_choice, body.parallel_tool_calls, auto=parser is not None)
        except ResponsesError as err:
            raise _responses_api_error(err) from None
        except ToolRequestError as err:
            raise APIError(400, str(err), param=err.field) from None
        auto = auto_tool_parser(tools_asked, tool_choice)
        limit = next((v for v in (body.max_output_tokens, body.max_tokens) if v is not None), default_limit)
        params = _sampling(body, limit, logprobs, defaults, tools=tools)
        groups = await asyncio.to_thread(
            lambda: [make_requests(apply_template(turns, "input", tools=tools_asked), None, params, body)])
        request = groups[0][0]
        head = _response_head(body, params)
        output = ResponseOutput(tools, auto)

        def api_logprobs(start: int) -> list[dict]:
            return [] if logprobs is None else _responses_logprobs(llm.codec, request.logprobs[start:], logprobs)

        def finished() -> dict:
            complete = request.finish_reason != "length"
            response = {**head, "status": "completed" if complete else "incomplete", "output": output.items,
                        "incomplete_details": None if complete else {"reason": "max_output_tokens"},
                        "usage": responses_usage(len(request.prompt_token_ids), len(request.output_token_ids),
                                                 request.num_cached_tokens)}
            if body.store:
                stored.put(response, earlier + added + output_turns(output.items), input_items(body.input))
            return response

        if not body.stream:
            if not await _run_to_end(engine, http, groups):
                return Response(status_code=499)  # the client left
            output.feed(request.text, api_logprobs(0))
            output.finish(request.text, request.finish_reason)
            return finished()

        events = _events(engine, groups)
        first_event = await _first_event(events)

        async def sse() -> AsyncIterator[str]:
            def frame(event: dict) -> str:
                return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

            yield frame(output.event("response.created", response=head))
            yield frame(output.event("response.in_progress", response=head))
            logprobs_sent = 0
            try:
                event = first_event
                while event is not None:
                    new_logprobs = api_logprobs(logprobs_sent)
                    logprobs_sent += len(new_logprobs)
                    for piece in output.feed(event.delta, new_logprobs):
                        yield frame(piece)
                    event = await anext(events, None)
                for piece in output.finish(request.text, request.finish_reason):
                    yield frame(piece)
                response = finished()
                yield frame(output.event(f"response.{response['status']}", response=response))
            except Exception as err:  # after the 200: the response fails in-band, as OpenAI reports it
                error = _engine_error(err)
                failed = {**head, "status": "failed", "output": output.items,
                          "error": {"code": error.kind, "message": error.message}}
                yield frame(output.event("response.failed", response=failed))
            finally:
                await events.aclose()

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict:
        try:
            return stored.get(response_id).response
        except ResponsesError as err:
            raise _responses_api_error(err) from None

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, order: Literal["asc", "desc"] = "desc", limit: int = 20,
                               after: str | None = None, before: str | None = None) -> dict:
        """A stored response's own input items (client.responses.input_items.list)."""
        if not 1 <= limit <= 100:
            raise APIError(400, "limit must be in [1, 100]", param="limit")
        try:
            return page(stored.get(response_id).input_items, order, limit, after, before)
        except ResponsesError as err:
            raise _responses_api_error(err) from None

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        try:
            stored.delete(response_id)
        except ResponsesError as err:
            raise _responses_api_error(err) from None
        return {"id": response_id, "object": "response", "deleted": True}

    return app


def _refuse_unsupported_responses(body: ResponsesBody) -> None:
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


def _responses_api_error(err: ResponsesError) -> APIError:
    return APIError(err.status, str(err), "not_found_error" if err.status == 404 else "invalid_request_error", err.param)


def _response_head(body: ResponsesBody, params: SamplingParams) -> dict:
    """A response's fields that do not depend on its answer (as in response.created); temperature and top_p as
    sampled (the model's recommended values where the request set none)."""
    return {
        "id": f"resp_{body.request_id or uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
        "model": body.model, "status": "in_progress", "output": [], "error": None, "incomplete_details": None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
        "reasoning": None, "store": body.store, "temperature": params.temperature, "top_p": params.top_p,
        "top_logprobs": body.top_logprobs, "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
        "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "truncation": body.truncation,
        "user": body.user, "usage": None,
    }


def _responses_logprobs(codec, logprobs: list[TokenLogprob], top: int) -> list[dict]:
    """The Responses API's logprobs: each token's text, its UTF-8 bytes, its logprob and the `top` likeliest."""
    def entry(token: int, logprob: float) -> dict:
        text = codec.decode([token])
        return {"token": text, "bytes": list(text.encode()), "logprob": logprob}

    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top[:top]]}
            for lp in logprobs]


def _completion_prompts(prompt) -> list[tuple[str | None, list[int] | None]]:
    if isinstance(prompt, str):
        return [(prompt, None)]
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    if all(isinstance(t, int) for t in prompt):
        return [(None, list(prompt))]
    if all(isinstance(p, str) for p in prompt):
        return [(p, None) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [(None, list(p)) for p in prompt]
    raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a list of lists", param="prompt")


def _adds_bos(given: bool | None, chat: bool) -> bool:
    """vLLM's add_special_tokens: as given, else the completions endpoint adds the BOS token (where the tokenizer
    does) and the chat endpoint, whose template writes it, does not."""
    return given if given is not None else not chat


def _token_name(codec, token: int, as_ids: bool) -> str:
    """A token as logprobs name it: its text, or "token_id:<id>" (vLLM's return_tokens_as_token_ids: a token that is
    part of a UTF-8 character has no text of its own)."""
    return f"token_id:{token}" if as_ids else codec.decode([token])


def _logprobs_content(codec, logprobs: list[TokenLogprob], top: int | None = None, as_ids: bool = False) -> list[dict]:
    return [
        {"token": _token_name(codec, lp.token_id, as_ids), "logprob": lp.logprob,
         "top_logprobs": [{"token": _token_name(codec, t, as_ids), "logprob": v} for t, v in lp.top[:top]]}
        for lp in logprobs
    ]


def _vllm_prompt_logprobs(codec, request: EngineRequest, top: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first) {token id: {logprob, rank, decoded_token}} for
    the token itself and the `top` most likely ones."""
    entries: list[dict | None] = [None]
    for lp in request.prompt_logprobs[1:]:
        entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": codec.decode([lp.token_id])}}
        for rank, (token, logprob) in enumerate(lp.top[:top], start=1):
            entry.setdefault(str(token), {"logprob": logprob, "rank": rank, "decoded_token": codec.decode([token])})
        entries.append(entry)
    return entries


def _completion_choice(codec, index: int, request: EngineRequest, echo: bool = False,
                       prompt_logprobs: int | None = None, as_ids: bool = False) -> dict:
    # the same fields as the last chunk of a stream, over all of the request's tokens
    final = TokenEvent(request, request.text, True)
    choice = _completion_chunk(codec, index, final, True, 0, echo, as_ids)
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = _vllm_prompt_logprobs(codec, request, prompt_logprobs)
    return choice


def _chat_choice(codec, index: int, request: EngineRequest, tools: ForcedTools | None = None, echo: str = "",
                 as_ids: bool = False, parser: ToolCallParser | None = None) -> dict:
    message, finish_reason = {"role": "assistant", "content": echo + request.text}, request.finish_reason
    calls = tools.tool_calls(request.text) if tools is not None and finish_reason == "stop" else None
    if calls:  # (an answer cut by max_tokens is no call: it stays text, finish_reason "length")
        message = {"role": "assistant", "content": None, "tool_calls": calls}
        finish_reason = _tool_finish_reason(tools)
    parsed = _auto_calls(parser, request.text, finish_reason)
    if parsed.calls:  # calls the model made by itself (tool_choice "auto"), after the text before them, if any
        message = {"role": "assistant", "content": request.text[:parsed.content_end].strip() or None,
                   "tool_calls": [tool_call(name, arguments) for name, arguments in parsed.calls]}
        finish_reason = "tool_calls"
    choice = {"index": index, "message": message, "finish_reason": finish_reason, "stop_reason": request.stop_reason,
              "logprobs": None}
    if request.params.logprobs is not None:
        choice["logprobs"] = {"content": _logprobs_content(codec, request.logprobs, as_ids=as_ids)}
    return choice


def _completion_chunk(codec, index: int, event: TokenEvent, first: bool, logprob_from: int, echo: bool = False,
                      as_ids: bool = False) -> dict:
    request = event.request
    text = event.delta
    if echo and first:  # the prompt comes first, as the client sent it (token ids: decoded)
        prompt = request.prompt if request.prompt is not None else codec.decode(request.prompt_token_ids)
        text = prompt + text
    chunk = {"index": index, "text": text, "finish_reason": request.finish_reason if event.finished else None,
             "stop_reason": request.stop_reason if event.finished else None, "logprobs": None}  # vLLM's stop_reason
    if request.params.logprobs is not None:
        content = _logprobs_content(codec, request.logprobs[logprob_from:], as_ids=as_ids)
        if echo and first:  # the first prompt token has no logprob: null, as OpenAI's echo gives it
            content = [{"token": _token_name(codec, request.prompt_token_ids[0], as_ids), "logprob": None,
                        "top_logprobs": None}] + \
                _logprobs_content(codec, request.prompt_logprobs[1:], request.params.logprobs, as_ids) + content
        chunk["logprobs"] = {
            "tokens": [c["token"] for c in content], "token_logprobs": [c["logprob"] for c in content],
            "top_logprobs": [None if c["top_logprobs"] is None else {t["token"]: t["logprob"] for t in c["top_logprobs"]}
                             for c in content],
        }
    return chunk


def _tool_finish_reason(tools: ForcedTools) -> str:
    return "stop" if tools.name is not None else "tool_calls"  # OpenAI's and vLLM's for a named function; vLLM's


def _auto_calls(parser: ToolCallParser | None, text: str, finish_reason: str | None) -> ParsedCalls:
    """The calls a finished answer makes in the model's own syntax (none without a parser, or when it was cut)."""
    if parser is None or finish_reason != "stop":
        return ParsedCalls(len(text), [])
    return parser.parse(text)


def _chat_chunk(codec, index: int, event: TokenEvent, first: bool, logprob_from: int,
                tools: ForcedTools | None = None, echo: str = "", as_ids: bool = False,
                auto: AutoToolStream | None = None) -> dict | None:
    """A stream's chunk for `event`, or None when there is nothing to send yet."""
    request = event.request
    finish_reason = request.finish_reason if event.finished else None
    if auto is not None:  # content while it surely is content; calls, whole, at the end
        rid = request.request_id
        text, content = auto.push(rid, event.delta)
        parsed = _auto_calls(auto.parser, text, finish_reason) if event.finished else None
        if parsed is not None:
            content += auto.rest(rid, parsed.content_end)
        if not content and parsed is None:
            return None
        delta = {"content": content} if rid in auto.text_started else {"role": "assistant", "content": content}
        auto.text_started.add(rid)
        if parsed is not None and parsed.calls:
            delta["tool_calls"] = [{"index": i, **tool_call(name, arguments)} for i, (name, arguments) in enumerate(parsed.calls)]
            finish_reason = "tool_calls"
    elif tools is None:
        delta = {"role": "assistant", "content": echo + event.delta} if first else {"content": event.delta}
    elif tools.name is not None:  # one call: its arguments stream as they come
        call = {"index": 0, **tool_call(tools.name, event.delta)} if first else {"index": 0, "function": {"arguments": event.delta}}
        delta = {"role": "assistant", "tool_calls": [call]} if first else {"tool_calls": [call]}
    else:  # a list of calls: known when it is complete
        if not event.finished:
            return None
        calls = tools.tool_calls(request.text) if finish_reason == "stop" else None
        delta = {"role": "assistant", "tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]} if calls else \
            {"role": "assistant", "content": request.text}
        finish_reason = _tool_finish_reason(tools) if calls else finish_reason
    chunk = {"index": index, "delta": delta, "finish_reason": finish_reason,
             "stop_reason": request.stop_reason if event.finished else None, "logprobs": None}
    if event.request.params.logprobs is not None:
        chunk["logprobs"] = {"content": _logprobs_content(codec, event.request.logprobs[logprob_from:], as_ids=as_ids)}
    return chunk


def _usage(groups: list[list[EngineRequest]], completion: int | None = None) -> dict:
    """`completion`: the tokens sent so far, where the stream is behind the engine (continuous usage stats)."""
    prompt = sum(len(g[0].prompt_token_ids) for g in groups)
    if completion is None:
        completion = sum(len(r.output_token_ids) for g in groups for r in g)
    cached = sum(g[0].num_cached_tokens for g in groups)  # prompt tokens the prefix cache held (0 without it)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _events(engine: AsyncEngine, groups: list[list[EngineRequest]]) -> AsyncIterator[TokenEvent]:
    """Events of all requests of one HTTP call, as they come."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(group: list[EngineRequest]) -> None:
        try:
            async for event in engine.generate(group):
                await merged.put(event)
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await merged.put(err)
        finally:
            await merged.put(None)

    tasks = [asyncio.create_task(pump(g)) for g in groups]
    try:
        remaining = len(tasks)
        while remaining:
            item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()  # aborts whatever the client no longer waits for
        await asyncio.gather(*tasks, return_exceptions=True)


def _engine_error(err: BaseException) -> APIError:
    if isinstance(err, EngineOverloaded):
        return APIError(503, str(err), "server_overloaded")
    if isinstance(err, EngineStopped):
        return APIError(503, str(err), "server_shutting_down")
    return APIError(500, f"generation failed: {err}", "server_error")


async def _run_to_end(engine: AsyncEngine, http: Request, groups: list[list[EngineRequest]]) -> bool:
    """Generate the requests to their end; False when the client left first (generation then stops)."""
    watcher = asyncio.create_task(_watch_disconnect(http))
    collector = asyncio.create_task(_collect(_events(engine, groups)))
    done, _ = await asyncio.wait({watcher, collector}, return_when=asyncio.FIRST_COMPLETED)
    if collector not in done:
        collector.cancel()
        await asyncio.gather(collector, return_exceptions=True)
        return False
    watcher.cancel()
    if collector.exception() is not None:
        raise _engine_error(collector.exception())
    return True


async def _first_event(events: AsyncIterator[TokenEvent]) -> TokenEvent | None:
    """A stream's first event, awaited before its 200 is sent, so that capacity errors are still HTTP errors."""
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None
    except Exception as err:
        raise _engine_error(err) from None


async def _respond(engine, http: Request, body: SamplingFields, groups, kind: str, choice, chunk):
    codec = engine.engine.codec
    response_id = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{body.request_id or uuid.uuid4().hex}"
    created = int(time.time())
    flat = [r for g in groups for r in g]
    index_of = {r.request_id: i for i, r in enumerate(flat)}

    if not body.stream:
        if not await _run_to_end(engine, http, groups):
            return Response(status_code=499)  # the client left
        response = {
            "id": response_id, "object": kind, "created": created, "model": body.model,
            "choices": [choice(codec, index_of[r.request_id], r) for r in flat], "usage": _usage(groups),
        }
        if kind == "chat.completion" and body.prompt_logprobs is not None:  # vLLM gives a chat's once, at the top
            response["prompt_logprobs"] = _vllm_prompt_logprobs(codec, flat[0], body.prompt_logprobs)
        return response

    events = _events(engine, groups)
    first_event = await _first_event(events)

    options = body.stream_options or StreamOptions()
    continuous_usage = options.include_usage and options.continuous_usage_stats

    async def sse() -> AsyncIterator[str]:
        chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
        started: set[str] = set()
        logprobs_sent: dict[str, int] = {}
        tokens_sent = 0  # one event per token (but a max_tokens 0 request's one event, which has none)

        def frame(choices: list[dict], usage: dict | None = None) -> str:
            payload = {"id": response_id, "object": chunk_kind, "created": created, "model": body.model, "choices": choices}
            if usage is not None:
                payload["usage"] = usage
            return f"data: {json.dumps(payload)}\n\n"

        try:
            event = first_event
            while event is not None:
                rid = event.request.request_id
                first = rid not in started
                started.add(rid)
                sent = logprobs_sent.get(rid, 0)
                tokens_sent += 1 if event.request.output_token_ids else 0
                piece = chunk(codec, index_of[rid], event, first, sent)
                if piece is not None:  # (a chunk held back sends its logprobs with the next one)
                    yield frame([piece], _usage(groups, tokens_sent) if continuous_usage else None)
                    logprobs_sent[rid] = len(event.request.logprobs)
                event = await anext(events, None)
            if options.include_usage:
                yield frame([], _usage(groups))
            yield "data: [DONE]\n\n"
        except Exception as err:  # after the 200: report in-band, as OpenAI does
            error = _engine_error(err)
            yield f"data: {json.dumps({'error': {'message': error.message, 'type': error.kind, 'code': error.status}})}\n\n"
        finally:
            await events.aclose()

    return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _collect(events: AsyncIterator[TokenEvent]) -> None:
    async for _ in events:
        pass


async def _watch_disconnect(http: Request) -> None:
    while not await http.is_disconnected():
        await asyncio.sleep(0.25)
