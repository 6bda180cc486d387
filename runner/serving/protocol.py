"""The OpenAI API's request bodies as this server reads them (OpenAI's names, plus vLLM's extras), and its error
object. Every router and serving class speaks these types."""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator


class APIError(Exception):
    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_response(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status
    )


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


def lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """Where a string of `value` holds a lone UTF-16 surrogate ("\\ud800", which JSON allows and UTF-8 cannot
    encode, so no tokenizer can read it), as a dotted path; None if nowhere."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
    elif isinstance(value, dict):
        for key, item in value.items():
            found = lone_surrogate_at(key, path) or lone_surrogate_at(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if found := lone_surrogate_at(item, f"{path}.{index}" if path else str(index)):
                return found
    return None


class Body(BaseModel):
    """Every request body: strings must be text that UTF-8 can encode."""

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        if (where := lone_surrogate_at(data)) is not None:
            raise ValueError(f"{where} holds a lone UTF-16 surrogate, which is not text")
        return data


class SamplingFields(Body):
    """The sampling fields both endpoints share (OpenAI's names, plus vLLM's extras). Counts are strict integers:
    `true` is not 1."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        # OpenAI reads null as "not given" for every optional parameter, and some clients send nulls for all of them
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    model: str
    max_tokens: StrictInt | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: StrictInt = -1
    min_p: float = 0.0
    n: StrictInt = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: StrictInt | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: StrictInt = 0
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: StrictInt | None = None  # vLLM's: each prompt token's logprob, rank and top ones (not streamed)
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
    truncate_prompt_tokens: StrictInt | None = None
    add_special_tokens: bool | None = None  # None: the endpoint's default (completions add BOS, chat does not)
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>"
    request_id: str | None = None  # the response's id (after its "cmpl-" / "chatcmpl-")
    cache_salt: str | None = None  # prefix caching shares cached K/V only between requests with the same salt
    user: str | None = None


class CompletionBody(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: StrictInt | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class TokenizeBody(Body):
    """vLLM's /tokenize: a prompt, or chat messages to which the chat template is applied first."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None  # None: as the completions (prompt) or chat (messages) endpoint would


class DetokenizeBody(Body):
    model: str
    tokens: list[int]


class ChatBody(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = None
    tools: list[dict[str, Any]] | None = None  # called when tool_choice forces them (runner/serving/tool_calls.py)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    echo: bool = False  # vLLM's: an answer to a final assistant message starts with that message's content
    add_generation_prompt: bool = True  # vLLM's chat-template controls from here on
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None


class ResponsesBody(SamplingFields):
    """OpenAI's Responses API request (runner/serving/responses.py), with the sampling extras the other
    endpoints take."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    top_logprobs: StrictInt | None = None
    truncation: Literal["disabled"] = "disabled"  # "auto" (drop the oldest turns to fit) is not implemented


# Responses API fields this server does not implement, each with the test of a value that asks for nothing
UNSUPPORTED_RESPONSES_FIELDS = {
    "background": lambda value: not value,
    "conversation": lambda value: value is None,
    "prompt": lambda value: value is None,  # stored prompt templates
    "reasoning": lambda value: (
        not value or (isinstance(value, dict) and not any(value.values()))
    ),  # no reasoning models
    "max_tool_calls": lambda value: value is None,
}
