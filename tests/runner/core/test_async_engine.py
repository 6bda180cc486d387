"""The step loop's thread: what its callers get when a step, or the loop itself, fails."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from runner.core.args import EngineArgs
from runner.core.async_engine import AsyncEngine, EngineLoopError, EngineStopped
from runner.core.engine import LLMEngine
from runner.core.request import FinishReason
from runner.core.tensor_parallel import RankFailure
from runner.sampling.params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)


async def collect(engine: AsyncEngine, prompt: str) -> list[int]:
    request = engine.engine.new_request(prompt, None, GREEDY)
    async for _ in engine.generate([request]):
        pass
    return request.output_token_ids


def fail_step(llm: LLMEngine, number: int, error: Exception, once: Callable[[], bool] | None = None) -> None:
    """The engine's `number`-th step from now raises `error` (after waiting, up to 10 s, until `once()` holds); the
    others run."""
    working_step, steps = llm.step, 0

    def step():
        nonlocal steps
        steps += 1
        if steps == number:
            deadline = time.monotonic() + 10
            while once is not None and not once() and time.monotonic() < deadline:
                time.sleep(0.001)
            raise error
        return working_step()

    llm.step = step


def test_a_failing_step_fails_the_requests_it_ran_and_the_engine_serves_on(engine_factory):
    engine = AsyncEngine(LLMEngine(EngineArgs(engine_factory("gqa"), max_batch=2)))
    llm = engine.engine

    async def scenario():
        expected = await collect(engine, "hello")
        fail_step(llm, 2, RuntimeError("the graph call failed"))
        with pytest.raises(RuntimeError, match="the graph call failed"):
            await collect(engine, "hello")
        assert not llm.scheduler.running and sorted(llm.scheduler._free_rows) == [0, 1]  # its row is free again
        assert await collect(engine, "hello") == expected  # the next request runs as if nothing happened

    try:
        asyncio.run(scenario())
        assert engine.fatal is None
    finally:
        engine.shutdown(grace_seconds=1)


@pytest.mark.parametrize("failure", ["rank_failure", "error_in_error_handling"])
def test_an_engine_that_cannot_go_on_fails_every_request_and_refuses_new_ones(engine_factory, failure):
    """A tensor-parallel rank gone, or an error that escapes the step's own handling (here: aborting the failed
    requests fails too): the running and the waiting request both get the error (none hangs), `on_fatal` is told
    once, the loop thread ends and a new request is refused with the reason."""
    told: list[BaseException] = []
    # a token a step, so that the first request is still running at the failing step (in bursts of 8 its 8 tokens
    # could all come in the two steps before it)
    args = EngineArgs(engine_factory("gqa"), max_batch=1, num_scheduler_steps=1)
    engine = AsyncEngine(LLMEngine(args), on_fatal=told.append)
    llm = engine.engine
    error = RankFailure("rank 1 exited") if failure == "rank_failure" else RuntimeError("graph call failed")
    # the step fails once the second request is in the engine's hands: on a fast machine the first one's steps can
    # otherwise all run before the caller submits the second, which then is refused instead of failed
    fail_step(llm, 3, error, once=lambda: engine.num_waiting() > 0)

    def abort_fails(request):
        raise RuntimeError("the cache row could not be freed")

    if failure == "error_in_error_handling":
        llm.abort = abort_fails
    expected = RankFailure if failure == "rank_failure" else EngineLoopError

    async def scenario():
        outcomes = await asyncio.wait_for(
            asyncio.gather(collect(engine, "hello"), collect(engine, "world"), return_exceptions=True), timeout=30
        )
        assert [type(o) for o in outcomes] == [expected, expected], outcomes  # one ran, one waited for the row
        with pytest.raises(EngineStopped, match="the engine has stopped"):
            await collect(engine, "again")

    asyncio.run(scenario())
    engine._thread.join(timeout=5)
    assert not engine._thread.is_alive()
    assert isinstance(engine.fatal, expected) and told == [engine.fatal]
    if failure == "error_in_error_handling":
        assert "the cache row could not be freed" in str(engine.fatal)
    engine.shutdown(grace_seconds=0)


def test_a_caller_whose_event_loop_closed_is_aborted_and_the_engine_serves_on(engine_factory):
    """An in-process caller that closed its event loop mid-stream is a client gone: its request ends and frees
    the only row for the next one."""
    engine = AsyncEngine(LLMEngine(EngineArgs(engine_factory("gqa"), max_batch=1)))
    gone = engine.engine.new_request("hello", None, SamplingParams(max_tokens=200, ignore_eos=True))
    stream = engine.generate([gone])  # kept referenced: its finaliser would need the closed loop
    closed = asyncio.new_event_loop()
    closed.run_until_complete(stream.__anext__())
    closed.close()
    try:
        assert len(asyncio.run(asyncio.wait_for(collect(engine, "hello"), timeout=30))) == GREEDY.max_tokens
        assert gone.finish_reason == FinishReason.ABORT and len(gone.output_token_ids) < 200
        assert engine.fatal is None
    finally:
        engine.shutdown(grace_seconds=1)
