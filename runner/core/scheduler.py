"""Which requests run this step: one prompt chunk for the oldest request still prefilling, one token for every
request that is generating (vLLM v1's idea: a request is only "how many of its tokens are computed").

A long prompt is cut into chunks so running requests keep generating between its chunks: `shared_chunk` tokens at a
time while any request generates, the engine's largest chunk while none does (every chunk reads every weight once,
so one long chunk is faster than several short ones, and nobody waits on it). With prefix caching a request admitted
to a row starts after the longest prefix of its prompt some row holds (runner/core/prefix_cache.py)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from runner.core.prefix_cache import PrefixCopy, PrefixIndex
from runner.core.request import FinishReason, Request


@dataclass
class ScheduledStep:
    prefill: tuple[Request, int] | None = None  # request, number of prompt tokens to compute this step
    decode: list[Request] = field(default_factory=list)
    prefix_copies: list[PrefixCopy] = field(default_factory=list)  # to make, in order, before the step's graph calls

    @property
    def empty(self) -> bool:
        return self.prefill is None and not self.decode


class Scheduler:
    def __init__(
        self, max_rows: int, prefill_chunk: int, prefix_caching: bool = False, shared_chunk: int | None = None
    ) -> None:
        self.max_rows = max_rows
        self.prefill_chunk = prefill_chunk  # the largest chunk, while no request generates
        self.shared_chunk = min(shared_chunk or prefill_chunk, prefill_chunk)  # while some request generates
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._free_rows = list(range(max_rows))
        self.prefix_index = PrefixIndex() if prefix_caching else None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        while self.waiting and self._free_rows:
            request = self.waiting.popleft()
            self._free_rows.sort()
            request.row = self._free_rows.pop(0)  # lowest rows first keeps the decode batch bucket small
            self.running.append(request)
            self._reuse_prefix(request, step)
        for request in self.running:
            if request.fork_of is not None:  # its prompt is computed by the request it forks (LLMEngine._fork)
                continue
            if request.prefilling and step.prefill is None:
                if request.num_computed == request.num_cached_tokens:
                    # its first own chunk: the prompts of requests admitted with it (one chunk per step, oldest
                    # first) were computed since, and may share its prefix (a common system prompt); admitted this
                    # step, it finds what it found at admission, its own row winning the tie: no second copy
                    self._reuse_prefix(request, step)
                remaining = len(request.prompt_token_ids) - request.num_computed
                generating = any(r.fork_of is None and not r.prefilling for r in self.running)
                step.prefill = (request, min(remaining, self.shared_chunk if generating else self.prefill_chunk))
            elif not request.prefilling:
                step.decode.append(request)
        return step

    def _reuse_prefix(self, request: Request, step: ScheduledStep) -> None:
        # a request that wants its prompt's logprobs computes all of it: reused K/V come without logits
        if self.prefix_index is not None and request.params.prompt_logprobs is None:
            copy = self.prefix_index.admit(request, self.running)
            if copy is not None:
                step.prefix_copies.append(copy)

    def forks_of(self, request: Request) -> list[Request]:
        """The completions waiting for `request`'s prompt (running or still queued)."""
        return [r for r in [*self.running, *self.waiting] if r.fork_of is request]

    def finish(self, request: Request, reason: FinishReason) -> int | None:
        """End a request (done, aborted, disconnected) and free its cache row at once; returns that row (None if
        the request never had one). With prefix caching the row keeps what it computed until it is given away."""
        request.finish_reason = reason
        if request in self.running:
            self.running.remove(request)
            if self.prefix_index is not None:
                self.prefix_index.hold(request)
            self._free_rows.append(request.row)
            return request.row
        if request in self.waiting:
            self.waiting.remove(request)
        return None
