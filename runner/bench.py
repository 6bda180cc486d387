"""Measure an engine on one prompt: time to first token (prefill) and decode tokens/s at batch 1."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

from runner.llm_engine import LLMEngine
from runner.sampling import SamplingParams


@dataclass(frozen=True)
class Timing:
    prompt_tokens: int
    new_tokens: int
    ttft_ms: float  # prefill of the whole prompt + first token
    decode_tok_s: float  # tokens after the first, per second
    first_tokens: list[int]

    def to_dict(self) -> dict:
        return asdict(self)


def time_generation(engine: LLMEngine, prompt_ids: list[int], new_tokens: int) -> Timing:
    # EOS banned until the last token (min_tokens), as peers do with "ignore EOS", so every run is equally long
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0)
    start = time.perf_counter()
    request = engine.add_request(None, prompt_ids, params)
    first = None
    while not request.finished:
        engine.step()
        if first is None and request.output_token_ids:
            first = time.perf_counter()
    end = time.perf_counter()
    decoded = len(request.output_token_ids) - 1
    return Timing(
        len(prompt_ids), len(request.output_token_ids), (first - start) * 1000, decoded / (end - first) if decoded else 0.0,
        request.output_token_ids[:16],
    )


def median_timing(engine: LLMEngine, prompt_ids: list[int], new_tokens: int, runs: int) -> Timing:
    time_generation(engine, prompt_ids, min(new_tokens, 8))  # warm-up
    timings = [time_generation(engine, prompt_ids, new_tokens) for _ in range(runs)]
    return Timing(
        timings[0].prompt_tokens,
        timings[0].new_tokens,
        statistics.median(t.ttft_ms for t in timings),
        statistics.median(t.decode_tok_s for t in timings),
        timings[0].first_tokens,
    )
