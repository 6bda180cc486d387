"""The Python API, in the style of vLLM's `LLM`:

from runner import LLM, SamplingParams
llm = LLM("engine_dir")
outputs = llm.generate(["Hello"], SamplingParams(max_tokens=64, temperature=0.0))
print(outputs[0].outputs[0].text, outputs[0].outputs[0].token_ids)  # or outputs[0].text where n is 1
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from runner.core.args import EngineArgs
from runner.core.engine import LLMEngine, PromptError
from runner.core.request import RequestOutput, request_output
from runner.sampling.params import SamplingParams

Message = dict[str, str]
Prompt = str | dict  # a text, or vLLM's {"prompt": text} / {"prompt_token_ids": ids} (optionally with "cache_salt")


class LLM:
    def __init__(self, model: str | Path | EngineArgs, **options) -> None:
        """`model`: the engine directory (vLLM's name for what to load), or EngineArgs; `options`: EngineArgs'
        fields (vLLM's way: `LLM("engine", enable_prefix_caching=True)`). `generate`, `stream` and `chat` without
        sampling params use the model's recommended ones (get_default_sampling_params) unless
        generation_config="vllm"."""
        if isinstance(model, EngineArgs):
            if options:
                raise TypeError("give EngineArgs or keyword options, not both")
            args = model
        else:
            args = EngineArgs(model, **options)
        self.engine = LLMEngine(args)

    @property
    def tokenizer(self):
        return self.engine.codec

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the model's recommended values (temperature, top_k, top_p, min_p,
        repetition_penalty, max_tokens) where it has them; what `generate` and `chat` use when given none."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched; one RequestOutput per prompt, in their order, holding the n completions
        its SamplingParams ask for (completion i seeded seed + i). A prompt is a text, or as in vLLM a dict:
        {"prompt": text} or {"prompt_token_ids": ids}, either with an optional "cache_salt" (prefix caching shares K/V
        only within a salt); `prompt_token_ids` gives token-id prompts the older way. `use_tqdm`: a progress bar over
        the prompts (tqdm)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if (prompts is None) == (prompt_token_ids is None):
            raise PromptError("give either prompts or prompt_token_ids")
        items = (
            [_prompt(p) for p in prompts]
            if prompts is not None
            else [(None, list(ids), None) for ids in prompt_token_ids]
        )
        params = _per_prompt(
            self.get_default_sampling_params() if sampling_params is None else sampling_params, len(items)
        )
        per_prompt = []
        requests = []
        try:
            for (text, ids, salt), p in zip(items, params):
                per_prompt.append(self.engine.new_requests(text, ids, p, cache_salt=salt))
                requests += per_prompt[-1]
            for request in requests:
                self.engine.add(request)
            progress = _Progress(per_prompt) if use_tqdm else None
            for event in self.engine.run(requests):
                if progress is not None and event.finished:
                    progress.finished(event.request)
            if progress is not None:
                progress.close()
        finally:
            for request in requests:
                self.engine.abort(request)  # only unfinished ones: an exception must not leave rows taken
        return [request_output(completions) for completions in per_prompt]

    def stream(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text increments of one prompt as they are generated."""
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, list(prompt))
        request = self.engine.add_request(
            text, ids, self.get_default_sampling_params() if sampling_params is None else sampling_params
        )
        try:
            for event in self.engine.run([request]):
                if event.request is request and event.delta:
                    yield event.delta
        finally:
            self.engine.abort(request)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        use_tqdm: bool = False,
        chat_template: str | None = None,
        special_tokens_in_content: bool = False,
    ) -> list[RequestOutput]:
        """Apply the engine's chat template (or `chat_template`) to one conversation (or several) and generate the
        replies. `continue_final_message` (with add_generation_prompt=False): go on with the last (assistant) message
        instead of answering it; `chat_template_kwargs`: more template variables; `tools`: for templates that
        describe them. vLLM's LLM.chat arguments. Special-token text inside a message's content
        ("<|im_end|><|im_start|>system") stays plain text, as in `runner serve`, so that content from a user cannot
        open a turn of another role; `special_tokens_in_content=True` reads it as those tokens (what vLLM's
        LLM.chat does)."""
        codec = self.engine.codec
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            text = codec.apply_chat_template(
                list(conversation),
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                continue_final_message=continue_final_message,
                template_kwargs=chat_template_kwargs,
                chat_template=chat_template,
            )
            if special_tokens_in_content:
                prompts.append(text)
            else:
                contents = [m["content"] for m in conversation if isinstance(m.get("content"), str)]
                prompts.append({"prompt": text, "prompt_token_ids": codec.encode_chat(text, contents, True)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _per_prompt(params: SamplingParams | Sequence[SamplingParams], count: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"{len(params)} sampling params for {count} prompts")
    return params


def _prompt(prompt: Prompt) -> tuple[str | None, list[int] | None, str | None]:
    """(text, token ids, cache salt) of one prompt."""
    if isinstance(prompt, str):
        return prompt, None, None
    if isinstance(prompt, dict) and set(prompt) <= {"prompt", "prompt_token_ids", "cache_salt"}:
        ids = prompt.get("prompt_token_ids")
        if ids is not None:
            return prompt.get("prompt"), list(ids), prompt.get("cache_salt")
        if isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], None, prompt.get("cache_salt")
    raise PromptError(
        'a prompt is a string, {"prompt": text} or {"prompt_token_ids": [ids]} (with an optional '
        f'"cache_salt"), got {prompt!r:.80}'
    )


class _Progress:
    """A tqdm bar that advances when all completions of a prompt are done."""

    def __init__(self, groups: list[list]) -> None:
        from tqdm import tqdm  # only with use_tqdm (transformers, in the build and test set-ups, brings it)

        self._group = {id(r): index for index, group in enumerate(groups) for r in group}
        self._left = [len(group) for group in groups]
        self._bar = tqdm(total=len(groups), desc="prompts", unit="prompt")

    def finished(self, request) -> None:
        index = self._group[id(request)]
        self._left[index] -= 1
        if self._left[index] == 0:
            self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
