"""What every serving class shares: the engine, the served model's name and card, the model's sampling defaults,
turning a body's prompt or chat into engine requests, and the completion-shaped answer (object or SSE stream) that
the completions and chat APIs both give. No HTTP here: routers.py maps routes onto the serving classes."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import TypeVar

from pydantic import BaseModel

from runner.core.async_engine import AsyncEngine
from runner.core.engine import PromptError
from runner.core.request import Request as EngineRequest
from runner.core.tokenizer import ChatTemplateError
from runner.sampling.compile_process import GrammarBusy, GrammarError
from runner.sampling.logprobs import TokenLogprob
from runner.sampling.params import SamplingParams
from runner.serving.generation import Disconnected, engine_error, first_event, run_to_end, token_events, usage
from runner.serving.protocol import (
    APIError,
    ChatBody,
    CompletionBody,
    SamplingFields,
    StreamOptions,
    TokenizeBody,
)
from runner.serving.request_params import adds_bos, message_text
from runner.serving.tool_parsers import ToolCallParser

# the output limit's names: chat's newer and older, the Responses API's, completions'
LIMIT_FIELDS = ("max_completion_tokens", "max_output_tokens", "max_tokens")
# a structured output's spec: not text for the context, and its cost is bounded by the grammar compile's own limits
GRAMMAR_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "structured_outputs", "text")


Prepared = TypeVar("Prepared")


def text_length(value) -> int:
    """The characters of every string in a JSON-like value."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(str(key)) + text_length(item) for key, item in value.items())
    if isinstance(value, list):
        return sum(text_length(item) for item in value)
    return 0


class ServingContext:
    """`tool_call_parser`: reads the calls the model makes by itself (tool_choice "auto"); None: no such calls.
    `special_tokens_in_content`: special-token text inside a message's content is read as those tokens (as vLLM
    and transformers do); by default it stays plain text, so that no client can write a turn of another role.
    `structured_pool`: the threads that prepare requests with a structured output (`prepare`); None: the event
    loop's default executor, as for the others."""

    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        tool_call_parser: ToolCallParser | None = None,
        special_tokens_in_content: bool = False,
        structured_pool: Executor | None = None,
    ) -> None:
        self.engine, self.model_name, self.parser = engine, model_name, tool_call_parser
        self.structured_pool = structured_pool
        self.special_tokens_in_content = special_tokens_in_content
        self.llm = engine.engine
        self.codec = self.llm.codec
        # the model's recommended sampling, for what a request leaves unset
        self.defaults = self.llm.sampling_defaults
        # a chat answer without a limit may use the rest of the context (OpenAI's and vLLM's default), or the model's
        self.default_limit = self.defaults.get("max_tokens", self.llm.max_seq_len)
        self.model_card = {
            "id": model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "local",
            "max_model_len": self.llm.max_seq_len,
        }

    def check_size(self, body: BaseModel) -> None:
        """Refuses, before any templating or tokenizing, a body holding more text than the context could take in
        any tokenization (twice the characters the longest tokens would need to fill it), so that a huge prompt
        costs the server microseconds, not seconds of work that ends in the same refusal. A structured output's
        spec is not counted: it is not prompt text, and its compile has a deadline of its own. Nor may a chat hold
        more messages than the context has tokens: every message takes at least one."""
        for name in ("messages", "input"):
            if isinstance(turns := getattr(body, name, None), list) and len(turns) > self.llm.max_seq_len:
                raise APIError(
                    400,
                    f"the request holds {len(turns)} {name}; this model's context of {self.llm.max_seq_len} tokens "
                    "holds fewer (every message takes at least one token)",
                    param=name,
                )
        most = 2 * self.llm.max_seq_len * self.codec.longest_token
        if (chars := text_length(body.model_dump(exclude=set(GRAMMAR_FIELDS)))) > most:
            raise APIError(
                400,
                f"the request holds {chars} characters of text; this model's context of {self.llm.max_seq_len} "
                f"tokens takes at most about {most // 2}",
                param=next((n for n in ("messages", "input", "prompt") if getattr(body, n, None) is not None), None),
            )

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                "not_found_error",
                "model",
            )

    async def prepare(self, params: SamplingParams, make: Callable[[], Prepared]) -> Prepared:
        """`make()` (templating, tokenizing, a grammar's compile: `make_requests`) off the event loop. A request
        with a structured output is prepared on threads of its own: its compile may wait seconds for its turn, and
        must not hold the threads that every other request is prepared on."""
        pool = self.structured_pool if params.structured_outputs is not None else None
        return await asyncio.get_running_loop().run_in_executor(pool, make)

    def make_requests(
        self, prompt: str | None, ids: list[int] | None, params: SamplingParams, body: SamplingFields
    ) -> list[EngineRequest]:
        """A text prompt is tokenized here, with or without the BOS token as the body asks (the completions
        endpoint's default adds it, the chat endpoint's, whose template writes it, does not: vLLM's defaults)."""
        if ids is None and isinstance(prompt, str):
            chat_like = not isinstance(body, CompletionBody)
            ids = self.codec.encode(prompt, add_special_tokens=adds_bos(body.add_special_tokens, chat_like))
        self._check_context(ids, params, body)
        try:
            return self.llm.new_requests(prompt, ids, params, cache_salt=body.cache_salt)
        except PromptError as err:
            raise APIError(400, str(err), param="prompt") from None
        except GrammarBusy as err:
            raise APIError(503, str(err), "server_overloaded") from None
        except GrammarError as err:
            raise APIError(400, str(err), param="response_format") from None

    def _check_context(self, ids: list[int] | None, params: SamplingParams, body: SamplingFields) -> None:
        """A max_tokens the context cannot hold after the prompt is refused (vLLM's 400), not silently cut."""
        field = next((name for name in LIMIT_FIELDS if getattr(body, name, None) is not None), None)
        if field is None or ids is None or params.truncate_prompt_tokens is not None:
            return
        requested = getattr(body, field)
        # (a prompt that alone does not fit is the engine's to refuse, saying just that)
        if len(ids) < self.llm.max_seq_len < len(ids) + requested:
            raise APIError(
                400,
                f"this model's maximum context length is {self.llm.max_seq_len} tokens; the request asks for "
                f"{len(ids) + requested} ({len(ids)} in the prompt, {requested} to generate): lower {field} or "
                "shorten the prompt",
                param=field,
            )

    def chat_prompt(
        self, body: ChatBody | TokenizeBody, tools: list | None = None, documents: list | None = None
    ) -> tuple[str, list[int]]:
        """The body's chat through the template, as text and as ids (`render_chat`)."""
        # a message's other fields (an assistant's tool_calls, a tool result's tool_call_id) go to the template too
        turns = [{**(m.model_extra or {}), "role": m.role, "content": message_text(m.content)} for m in body.messages]
        return self.render_chat(
            turns,
            "messages",
            body.add_special_tokens,
            add_generation_prompt=body.add_generation_prompt,
            tools=tools,
            documents=documents,
            continue_final_message=body.continue_final_message,
            template_kwargs=body.chat_template_kwargs,
        )

    def render_chat(
        self, turns: list[dict], param: str, add_special_tokens: bool | None, **options
    ) -> tuple[str, list[int]]:
        """`turns` through the chat template, as text and as ids: the template's special tokens as tokens, the
        turns' own contents as text (unless `special_tokens_in_content`). A 400 naming `param` where either fails."""
        try:
            text = self.codec.apply_chat_template(turns, **options)
        except Exception as err:  # ChatTemplateError, or anything else a jinja template raises
            raise APIError(400, f"cannot apply the chat template: {err}", param=param) from None
        add_bos = adds_bos(add_special_tokens, chat=True)
        if self.special_tokens_in_content:
            return text, self.codec.encode(text, add_special_tokens=add_bos)
        contents = [turn["content"] for turn in turns if isinstance(turn.get("content"), str)]
        try:
            return text, self.codec.encode_chat(text, contents, add_special_tokens=add_bos)
        except ChatTemplateError as err:
            raise APIError(400, str(err), param=param) from None

    def auto_tool_parser(self, tools: list | None, tool_choice) -> ToolCallParser | None:
        """The parser that reads the model's own calls where the model decides (tool_choice "auto")."""
        if self.parser is None or not tools or tool_choice not in (None, "auto"):
            return None
        if "tools" not in (self.codec.info.chat_template or ""):
            raise APIError(
                400,
                "this engine's chat template does not show tools to the model, so it cannot decide to "
                'call one: use tool_choice "required" or a named function',
                param="tool_choice",
            )
        return self.parser

    async def respond(
        self,
        disconnected: Disconnected,
        body: SamplingFields,
        groups: list[list[EngineRequest]],
        kind: str,
        choice,
        chunk,
    ) -> dict | AsyncIterator[str] | None:
        """The completion-shaped answer both the completions and the chat API give: a response object, an SSE stream
        (its lines), or None when the client left before the end. `choice(codec, index, request)` and
        `chunk(codec, index, event, first, logprob_from)` shape one choice of the API's kind."""
        engine, codec = self.engine, self.codec
        response_id = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{body.request_id or uuid.uuid4().hex}"
        created = int(time.time())
        index_of = {r.request_id: i for i, r in enumerate(r for g in groups for r in g)}
        if not body.stream:
            if not await run_to_end(engine, disconnected, groups):
                return None  # the client left
            return self._response_object(body, groups, kind, choice, response_id, created)

        events = token_events(engine, groups)
        opening = await first_event(events)

        options = body.stream_options or StreamOptions()
        continuous_usage = options.include_usage and options.continuous_usage_stats

        async def sse() -> AsyncIterator[str]:
            chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
            started: set[str] = set()
            logprobs_sent: dict[str, int] = {}
            tokens_sent = 0  # one event per token (but a max_tokens 0 request's one event, which has none)

            def frame(choices: list[dict], counts: dict | None = None) -> str:
                payload = {
                    "id": response_id,
                    "object": chunk_kind,
                    "created": created,
                    "model": body.model,
                    "choices": choices,
                }
                if counts is not None:
                    payload["usage"] = counts
                return f"data: {json.dumps(payload)}\n\n"

            try:
                event = opening
                while event is not None:
                    rid = event.request.request_id
                    first = rid not in started
                    started.add(rid)
                    sent = logprobs_sent.get(rid, 0)
                    tokens_sent += 1 if event.request.output_token_ids else 0
                    piece = chunk(codec, index_of[rid], event, first, sent)
                    if piece is not None:  # (a chunk held back sends its logprobs with the next one)
                        yield frame([piece], usage(groups, tokens_sent) if continuous_usage else None)
                        logprobs_sent[rid] = len(event.request.logprobs)
                    event = await anext(events, None)
                if options.include_usage:
                    yield frame([], usage(groups))
                yield "data: [DONE]\n\n"
            except Exception as err:  # after the 200: report in-band, as OpenAI does
                error = engine_error(err)
                in_band = {"error": {"message": error.message, "type": error.kind, "code": error.status}}
                yield f"data: {json.dumps(in_band)}\n\n"
            finally:
                await events.aclose()

        return sse()

    def _response_object(
        self, body: SamplingFields, groups: list[list[EngineRequest]], kind: str, choice, response_id: str, created: int
    ) -> dict:
        flat = [r for g in groups for r in g]
        response = {
            "id": response_id,
            "object": kind,
            "created": created,
            "model": body.model,
            "choices": [choice(self.codec, index, r) for index, r in enumerate(flat)],
            "usage": usage(groups),
        }
        if kind == "chat.completion" and body.prompt_logprobs is not None:  # vLLM gives a chat's once, at the top
            response["prompt_logprobs"] = vllm_prompt_logprobs(self.codec, flat[0], body.prompt_logprobs)
        return response


def token_name(codec, token: int, as_ids: bool) -> str:
    """A token as logprobs name it: its text, or "token_id:<id>" (vLLM's return_tokens_as_token_ids: a token that is
    part of a UTF-8 character has no text of its own)."""
    return f"token_id:{token}" if as_ids else codec.decode([token])


def logprobs_content(codec, logprobs: list[TokenLogprob], top: int | None = None, as_ids: bool = False) -> list[dict]:
    return [
        {
            "token": token_name(codec, lp.token_id, as_ids),
            "logprob": lp.logprob,
            "top_logprobs": [{"token": token_name(codec, t, as_ids), "logprob": v} for t, v in lp.top[:top]],
        }
        for lp in logprobs
    ]


def vllm_prompt_logprobs(codec, request: EngineRequest, top: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first) {token id: {logprob, rank, decoded_token}} for
    the token itself and the `top` most likely ones."""
    entries: list[dict | None] = [None]
    for lp in request.prompt_logprobs[1:]:
        entry = {
            str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": codec.decode([lp.token_id])}
        }
        for rank, (token, logprob) in enumerate(lp.top[:top], start=1):
            entry.setdefault(str(token), {"logprob": logprob, "rank": rank, "decoded_token": codec.decode([token])})
        entries.append(entry)
    return entries
