"""The step loop: schedule -> execute on the graphs -> sample -> check stops. Shared by the Python API and the CLI."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engines.backends import open_backend
from engines.format import open_artifact
from runner.executor import Executor
from runner.request import Request, TokenLogprob
from runner.sampling import SamplingParams, apply_penalties, sample_token, top_logprobs
from runner.scheduler import Scheduler
from runner.tokenizer import IncrementalDetokenizer, TextCodec


class PromptError(ValueError):
    """A prompt this engine cannot serve (empty, too long, token ids out of range)."""


@dataclass(frozen=True)
class TokenEvent:
    """What one step produced for one request: a text increment, and whether the request is done."""

    request: Request
    delta: str
    finished: bool


class LLMEngine:
    def __init__(
        self, engine_dir: str | Path, threads: int | None = None, verify_checksums: bool = True, max_batch: int | None = None
    ) -> None:
        self.artifact = open_artifact(engine_dir, verify_checksums=verify_checksums)
        manifest = self.artifact.manifest
        self.manifest = manifest
        self.codec = TextCodec(self.artifact.path(manifest.tokenizer.file), manifest.tokenizer)
        self.executor = Executor(self.artifact, open_backend(self.artifact, threads=threads))
        rows = self.executor.max_rows if max_batch is None else max_batch
        if not 1 <= rows <= self.executor.max_rows:
            raise ValueError(f"max_batch must be in [1, {self.executor.max_rows}] for this engine (built with --max-batch)")
        self.scheduler = Scheduler(rows, self.executor.max_chunk)
        self.eos_token_ids = set(manifest.model.eos_token_ids)
        self._ids = itertools.count()

    @property
    def max_seq_len(self) -> int:
        return self.manifest.max_seq_len

    def add_request(self, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams) -> Request:
        request = self.new_request(prompt, prompt_token_ids, params)
        self.add(request)
        return request

    def add(self, request: Request) -> None:
        self.scheduler.add(request)

    def new_request(
        self, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams, index: int = 0
    ) -> Request:
        """Validate and tokenize a prompt into a Request, without touching the scheduler (safe from any thread).
        `index` numbers the completions of one prompt (n > 1): completion i samples with seed + i."""
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise PromptError(f"a prompt must be a string, got {type(prompt).__name__}")
            prompt_token_ids = self.codec.encode(prompt)
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        if not prompt_token_ids:
            raise PromptError("the prompt is empty")
        vocab = self.manifest.model.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise PromptError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_token_ids) >= self.max_seq_len:
            raise PromptError(
                f"the prompt has {len(prompt_token_ids)} tokens; this engine's max sequence length is "
                f"{self.max_seq_len} (prompt + generated tokens), so at most {self.max_seq_len - 1} prompt tokens"
            )
        return Request(
            request_id=str(next(self._ids)),
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            detokenizer=IncrementalDetokenizer(self.codec),
            rng=np.random.default_rng(None if params.seed is None else params.seed + index),
        )

    def abort(self, request: Request) -> None:
        if not request.finished:
            self.scheduler.finish(request, "abort")

    def step(self) -> list[TokenEvent]:
        step = self.scheduler.schedule()
        if step.empty:
            return []
        # every running request's cached positions must survive a re-size, not only this step's
        scheduled = {id(r): 1 for r in step.decode}
        if step.prefill is not None:
            scheduled[id(step.prefill[0])] = step.prefill[1]
        length = max(r.num_computed + scheduled.get(id(r), 0) for r in self.scheduler.running)
        self.executor.reserve(self.scheduler.rows_in_use(), length)

        events = []
        if step.decode:
            logits = self.executor.decode(
                [r.row for r in step.decode], [r.output_token_ids[-1] for r in step.decode], [r.num_computed for r in step.decode]
            )
            for request, row_logits in zip(step.decode, logits):
                request.num_computed += 1
                events.append(self._append_token(request, row_logits))
        if step.prefill is not None:
            request, count = step.prefill
            start = request.num_computed
            row_logits = self.executor.prefill(request.row, request.prompt_token_ids[start:start + count], start)
            request.num_computed += count
            if not request.prefilling:
                events.append(self._append_token(request, row_logits))
        if not self.scheduler.running:
            self.executor.cache.release()
        return events

    def _append_token(self, request: Request, logits: np.ndarray) -> TokenEvent:
        params = request.params
        raw_logits = logits
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        logits = apply_penalties(logits, params, request.prompt_token_ids, request.output_token_ids)
        if len(request.output_token_ids) < params.min_tokens and stop_ids:
            logits = logits.copy() if logits is raw_logits else logits
            logits[list(stop_ids)] = -np.inf
        token = sample_token(logits, params, request.rng)
        if params.logprobs is not None:
            # the model's own distribution, before penalties and sampling filters (vLLM's default)
            logprobs, top = top_logprobs(raw_logits, params.logprobs)
            request.logprobs.append(TokenLogprob(token, float(logprobs[token]), [(int(t), float(logprobs[t])) for t in top]))
        request.output_token_ids.append(token)
        request.detokenizer.push(token)

        reason = None
        full_text = request.detokenizer.text
        visible = full_text
        if token in stop_ids:
            reason = "stop"
        for stop in params.stop:
            index = full_text.find(stop)
            if index != -1:
                visible, reason = full_text[:index], "stop"
                break
        if reason is None and (len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_seq_len):
            reason = "length"
        if reason is None:
            visible = full_text[: len(full_text) - _held_back(full_text, params.stop)]
        delta = visible[len(request.text):]
        request.text = visible
        if reason is not None:
            self.scheduler.finish(request, reason)
        return TokenEvent(request, delta, reason is not None)

    def run(self, requests: list[Request]) -> Iterator[TokenEvent]:
        """Step until every request in `requests` is finished, yielding every event on the way."""
        while any(not r.finished for r in requests):
            yield from self.step()


def _held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters could still grow into a stop string (not shown yet while streaming)."""
    held = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:size]):
                held = size
                break
    return held
