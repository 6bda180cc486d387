"""A request body -> the engine's SamplingParams: the model's recommended defaults for what the body leaves unset,
structured outputs from any of their spellings, and a 400 naming the field for what this server does not do."""

from __future__ import annotations

from typing import Any

from runner.sampling.params import SamplingParams
from runner.sampling.structured import StructuredOutputs
from runner.serving.protocol import UNSUPPORTED_FIELDS, APIError, SamplingFields
from runner.serving.tool_calls import ForcedTools


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


def sampling_params(
    body: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    defaults: dict[str, Any],
    echo_logprobs: int | None = None,
    tools: ForcedTools | None = None,
) -> SamplingParams:
    """`defaults`: the model's recommended sampling, for the fields the body leaves unset (max_tokens: for a None
    `max_tokens`); `echo_logprobs`: how many top prompt logprobs the completions API's echo shows (None: no echo);
    `tools`: the tool calls the answer must be."""
    _refuse_unsupported(body)
    structured = structured_outputs(body)
    if tools is not None:
        if structured is not None:
            raise APIError(
                400,
                "a forced tool call is a structured output already: drop response_format / guided_*",
                param="tool_choice",
            )
        structured = StructuredOutputs(json=tools.output_schema())
    if body.prompt_logprobs is not None and body.stream:
        raise APIError(400, "prompt_logprobs are not available when streaming", param="prompt_logprobs")
    wanted = [k for k in (body.prompt_logprobs, echo_logprobs) if isinstance(k, int)]
    prompt_logprobs = max(wanted) if wanted else body.prompt_logprobs  # a bad value is SamplingParams' to refuse
    defaulted = {
        name: getattr(body, name) if name in body.model_fields_set else defaults.get(name, getattr(body, name))
        for name in MODEL_DEFAULTED
    }
    try:
        return SamplingParams(
            **defaulted,
            structured_outputs=structured,
            max_tokens=max_tokens if max_tokens is not None else defaults.get("max_tokens", 16),
            n=body.n,
            seed=body.seed,
            stop=body.stop or [],
            stop_token_ids=body.stop_token_ids or [],
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=body.logit_bias or {},
            allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words or [],
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
        )
    except ValueError as err:
        raise APIError(400, str(err)) from None


def structured_outputs(body: SamplingFields) -> StructuredOutputs | None:
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
        raise APIError(
            400, f"response_format type {kind!r} is not one of text, json_object, json_schema", param="response_format"
        )
    for name, make in (
        ("guided_json", lambda v: StructuredOutputs(json=v)),
        ("guided_regex", lambda v: StructuredOutputs(regex=v)),
        ("guided_choice", lambda v: StructuredOutputs(choice=v)),
        ("structured_outputs", _vllm_structured_outputs),
    ):
        value = getattr(body, name)
        if value is not None:
            try:
                asked.append(make(value))
            except (ValueError, TypeError) as err:  # StructuredOutputs' own checks (an empty choice, say)
                raise APIError(400, f"{name}: {err}", param=name) from None
    if len(asked) > 1:
        raise APIError(
            400,
            "ask for one structured output (response_format, guided_* or structured_outputs)",
            param="response_format",
        )
    return asked[0] if asked else None


def _vllm_structured_outputs(fields: dict[str, Any]) -> StructuredOutputs:
    known = {"json", "json_object", "regex", "choice"}
    if not set(fields) <= known:
        raise APIError(
            400,
            f"structured_outputs supports {', '.join(sorted(known))}; not {', '.join(sorted(set(fields) - known))}",
            param="structured_outputs",
        )
    return StructuredOutputs(**fields)


def message_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise APIError(
                400, f"unsupported content part type {part.get('type')!r}: this model reads text only", param="messages"
            )
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def adds_bos(given: bool | None, chat: bool) -> bool:
    """vLLM's add_special_tokens: as given, else the completions endpoint adds the BOS token (where the tokenizer
    does) and the chat endpoint, whose template writes it, does not."""
    return given if given is not None else not chat
