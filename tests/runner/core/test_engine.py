"""The step loop's bursts of greedy decode calls (num_scheduler_steps): the same answers as one call per step, and
bursts only where nothing else needs the step."""

from __future__ import annotations

import json

import pytest

from runner.core.args import EngineArgs
from runner.core.engine import LLMEngine
from runner.core.request import FinishReason
from runner.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def engines(engine_factory):
    path = engine_factory("gqa", max_batch=4)
    return {steps: LLMEngine(EngineArgs(path, threads=1, num_scheduler_steps=steps)) for steps in (1, 8)}


def answers(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple]:
    requests = [engine.add_request(None, prompt, p) for prompt, p in zip(prompts, params)]
    for _ in engine.run(requests):
        pass
    return [(r.output_token_ids, r.text, r.finish_reason, r.stop_reason) for r in requests]


def test_bursts_answer_as_one_decode_call_per_step(engines):
    prompts = [[5, 6, 7, 8, 9], [11, 3, 4], [1, 2], [40, 41, 42, 43]]
    greedy = SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True)  # not a multiple of 8
    params = []
    for prompt in prompts:  # per prompt, stops that fall inside a burst, from its own greedy answer
        tokens, text = answers(engines[1], [prompt], [greedy])[0][:2]
        params.append(
            [
                greedy,
                SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True, stop=[text[len(text) // 2 :][:2]]),
                # a token it chooses, banned until min_tokens: the sampler graph picks the next best there
                SamplingParams(
                    max_tokens=21, temperature=0.0, ignore_eos=True, stop_token_ids=[tokens[5]], min_tokens=12
                ),
                SamplingParams(max_tokens=21, temperature=0.0, stop_token_ids=[tokens[9]]),
            ]
        )
    for kind in range(4):
        for chosen in ([0], [0, 1, 2, 3], [2]):  # alone and four rows in one burst
            picked = [prompts[i] for i in chosen], [params[i][kind] for i in chosen]
            assert answers(engines[8], *picked) == answers(engines[1], *picked)
    banned = params[0][2].stop_token_ids[0]
    assert banned not in answers(engines[8], prompts[:1], [params[0][2]])[0][0][:12]


def test_a_step_bursts_only_where_every_row_takes_the_argmax_and_nothing_waits(engine_factory):
    engine = LLMEngine(EngineArgs(engine_factory("gqa", max_batch=4), threads=1, max_batch=1, num_scheduler_steps=8))
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=30, temperature=0.8, seed=1, ignore_eos=True)
    first = engine.add_request(None, [5, 6, 7], greedy)
    assert len(engine.step()) == 1  # the prompt's step
    assert len(engine.step()) == 8
    queued = engine.add_request(None, [8, 9], sampled)  # waits for the only row
    assert len(engine.step()) == 1
    engine.abort(first)
    engine.step()  # the queued request's prompt
    assert len(engine.step()) == 1 and not queued.finished  # it samples


def test_num_scheduler_steps_must_be_positive(engine_factory):
    with pytest.raises(ValueError, match="num_scheduler_steps must be >= 1"):
        LLMEngine(EngineArgs(engine_factory("gqa", max_batch=4), num_scheduler_steps=0))


def test_finish_reasons_are_an_enum_that_reads_as_openais_strings(engines):
    engine = engines[1]
    ((tokens, _, reason, _),) = answers(
        engine, [[5, 6, 7]], [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)]
    )
    assert reason is FinishReason.LENGTH and reason == "length" and len(tokens) == 4
    assert json.dumps({"finish_reason": reason}) == '{"finish_reason": "length"}' and f"{reason}" == "length"
    request = engine.add_request(None, [5, 6, 7], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    engine.abort(request)
    assert request.finish_reason is FinishReason.ABORT
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=[tokens[1]])
    ((_, _, stopped, stop_reason),) = answers(engine, [[5, 6, 7]], [params])
    assert stopped is FinishReason.STOP and stop_reason == tokens[1]
