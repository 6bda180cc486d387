"""Which requests run this step: one prompt chunk for the oldest request still prefilling, one token for every
request that is generating (vLLM v1's idea: a request is only "how many of its tokens are computed").

A long prompt is cut into chunks so running requests keep generating between its chunks."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from runner.request import Request


@dataclass
class ScheduledStep:
    prefill: tuple[Request, int] | None = None  # request, number of prompt tokens to compute this step
    decode: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return self.prefill is None and not self.decode


class Scheduler:
    def __init__(self, max_rows: int, prefill_chunk: int) -> None:
        self.max_rows = max_rows
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._free_rows = list(range(max_rows))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> ScheduledStep:
        while self.waiting and self._free_rows:
            request = self.waiting.popleft()
            self._free_rows.sort()
            request.row = self._free_rows.pop(0)  # lowest rows first keeps the decode batch bucket small
            self.running.append(request)
        step = ScheduledStep()
        for request in self.running:
            if request.prefilling and step.prefill is None:
                remaining = len(request.prompt_token_ids) - request.num_computed
                step.prefill = (request, min(remaining, self.prefill_chunk))
            elif not request.prefilling:
                step.decode.append(request)
        return step

    def finish(self, request: Request, reason: str) -> int | None:
        """End a request (done, aborted, disconnected) and free its cache row at once; returns that row (None if
        the request never had one)."""
        request.finish_reason = reason
        if request in self.running:
            self.running.remove(request)
            self._free_rows.append(request.row)
            return request.row
        if request in self.waiting:
            self.waiting.remove(request)
        return None
