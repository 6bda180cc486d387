"""The Python API, in the style of vLLM's `LLM`:

    from runner import LLM, SamplingParams
    llm = LLM("engine_dir")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=64, temperature=0.0))
    print(outputs[0].outputs[0].text, outputs[0].outputs[0].token_ids)  # or outputs[0].text where n is 1
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from runner.llm_engine import DEFAULT_SPECULATIVE_MAX_ROWS, LLMEngine, PromptError
from runner.request import RequestOutput, request_output
from runner.sampling import SamplingParams

Message = dict[str, str]


class LLM:
    def __init__(
        self, engine_dir: str | Path, threads: int | None = None, verify_checksums: bool = True, max_batch: int | None = None,
        enable_prefix_caching: bool = False, speculative_max_rows: int | None = DEFAULT_SPECULATIVE_MAX_ROWS,
    ) -> None:
        """`enable_prefix_caching`: a prompt starts after the longest prefix whose K/V a cache row holds from an earlier
        or running request (runner/prefix_cache.py). `speculative_max_rows`: a speculative engine verifies drafts
        only in steps with at most this many generating rows (None: in every step)."""
        self.engine = LLMEngine(engine_dir, threads=threads, verify_checksums=verify_checksums, max_batch=max_batch,
                                enable_prefix_caching=enable_prefix_caching, speculative_max_rows=speculative_max_rows)

    @property
    def tokenizer(self):
        return self.engine.codec

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or token ids), batched; one RequestOutput per prompt, in their order,
        holding the n completions its SamplingParams ask for (completion i seeded seed + i)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if (prompts is None) == (prompt_token_ids is None):
            raise PromptError("give either prompts or prompt_token_ids")
        items = [(p, None) for p in prompts] if prompts is not None else [(None, list(ids)) for ids in prompt_token_ids]
        params = _per_prompt(sampling_params, len(items))
        per_prompt = []
        requests = []
        try:
            for (text, ids), p in zip(items, params):
                per_prompt.append(self.engine.new_requests(text, ids, p))
                requests += per_prompt[-1]
            for request in requests:
                self.engine.add(request)
            for _ in self.engine.run(requests):
                pass
        finally:
            for request in requests:
                self.engine.abort(request)  # only unfinished ones: an exception must not leave rows taken
        return [request_output(completions) for completions in per_prompt]

    def stream(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text increments of one prompt as they are generated."""
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, list(prompt))
        request = self.engine.add_request(text, ids, sampling_params or SamplingParams())
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
    ) -> list[RequestOutput]:
        """Apply the engine's chat template to one conversation (or several) and generate the replies.
        `continue_final_message` (with add_generation_prompt=False): go on with the last (assistant) message instead
        of answering it; `chat_template_kwargs`: more template variables; `tools`: for templates that describe them.
        vLLM's LLM.chat arguments."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.engine.codec.apply_chat_template(
            list(c), add_generation_prompt=add_generation_prompt, tools=tools,
            continue_final_message=continue_final_message, template_kwargs=chat_template_kwargs)
            for c in conversations]
        return self.generate(prompts, sampling_params)


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"{len(params)} sampling params for {count} prompts")
    return params
