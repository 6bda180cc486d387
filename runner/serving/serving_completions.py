"""OpenAI's (legacy) completions API, `POST /v1/completions`: prompts as texts or token ids, n completions each,
echo and logprobs, streamed or not."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator

from runner.core.engine import TokenEvent
from runner.core.request import Request as EngineRequest
from runner.serving.generation import Disconnected
from runner.serving.protocol import APIError, CompletionBody
from runner.serving.request_params import sampling_params
from runner.serving.serving_base import ServingContext, logprobs_content, token_name, vllm_prompt_logprobs


class ServingCompletions(ServingContext):
    async def create(self, body: CompletionBody, disconnected: Disconnected) -> dict | AsyncIterator[str] | None:
        """A response object, an SSE stream, or None when the client left (ServingContext.respond)."""
        self.check_model(body.model)
        self.check_size(body)
        # echo returns the prompt before the completion, with its tokens' logprobs when logprobs are asked for;
        # max_tokens 0 with echo returns the prompt alone (OpenAI's legacy way to score a text)
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens must be >= 1 (0 only with echo: the prompt alone)", param="max_tokens")
        params = sampling_params(
            body, body.max_tokens, body.logprobs, self.defaults, body.logprobs if body.echo else None
        )
        prompts = completion_prompts(body.prompt)
        groups = await self.prepare(
            params, lambda: [self.make_requests(text, ids, params, body) for text, ids in prompts]
        )
        as_ids = body.return_tokens_as_token_ids
        choice = functools.partial(
            completion_choice, echo=body.echo, prompt_logprobs=body.prompt_logprobs, as_ids=as_ids
        )
        chunk = functools.partial(completion_chunk, echo=body.echo, as_ids=as_ids)
        return await self.respond(disconnected, body, groups, "text_completion", choice, chunk)


def completion_prompts(prompt) -> list[tuple[str | None, list[int] | None]]:
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
    raise APIError(
        400, "prompt must be a string, a list of strings, a list of token ids or a list of lists", param="prompt"
    )


def completion_choice(
    codec,
    index: int,
    request: EngineRequest,
    echo: bool = False,
    prompt_logprobs: int | None = None,
    as_ids: bool = False,
) -> dict:
    # the same fields as the last chunk of a stream, over all of the request's tokens
    final = TokenEvent(request, request.text, True)
    choice = completion_chunk(codec, index, final, True, 0, echo, as_ids)
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(codec, request, prompt_logprobs)
    return choice


def completion_chunk(
    codec, index: int, event: TokenEvent, first: bool, logprob_from: int, echo: bool = False, as_ids: bool = False
) -> dict:
    request = event.request
    text = event.delta
    if echo and first:  # the prompt comes first, as the client sent it (token ids: decoded)
        prompt = request.prompt if request.prompt is not None else codec.decode(request.prompt_token_ids)
        text = prompt + text
    chunk = {
        "index": index,
        "text": text,
        "finish_reason": request.finish_reason if event.finished else None,
        "stop_reason": request.stop_reason if event.finished else None,
        "logprobs": None,
    }  # vLLM's stop_reason
    if request.params.logprobs is not None:
        content = logprobs_content(codec, request.logprobs[logprob_from:], as_ids=as_ids)
        if echo and first:  # the first prompt token has no logprob: null, as OpenAI's echo gives it
            content = (
                [
                    {
                        "token": token_name(codec, request.prompt_token_ids[0], as_ids),
                        "logprob": None,
                        "top_logprobs": None,
                    }
                ]
                + logprobs_content(codec, request.prompt_logprobs[1:], request.params.logprobs, as_ids)
                + content
            )
        chunk["logprobs"] = {
            "tokens": [c["token"] for c in content],
            "token_logprobs": [c["logprob"] for c in content],
            "top_logprobs": [
                None if c["top_logprobs"] is None else {t["token"]: t["logprob"] for t in c["top_logprobs"]}
                for c in content
            ],
        }
    return chunk
