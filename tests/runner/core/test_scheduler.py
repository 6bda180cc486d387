from runner.core.request import Request
from runner.core.scheduler import Scheduler
from runner.sampling.params import SamplingParams


def _request(name: str, prompt_len: int) -> Request:
    return Request(name, None, list(range(prompt_len)), SamplingParams(), detokenizer=None, rng=None)


def test_a_prompt_alone_goes_in_the_largest_chunks_and_in_shared_ones_while_others_generate():
    scheduler = Scheduler(max_rows=2, prefill_chunk=64, shared_chunk=16)
    first = _request("first", 100)
    scheduler.add(first)
    assert scheduler.schedule().prefill == (first, 64)
    first.num_computed = 64
    assert scheduler.schedule().prefill == (first, 36)
    first.num_computed = 100  # its prompt is in the cache: it generates from now on
    second = _request("second", 100)
    scheduler.add(second)
    step = scheduler.schedule()
    assert step.prefill == (second, 16) and step.decode == [first]
    scheduler.finish(first, "stop")
    assert scheduler.schedule().prefill == (second, 64)  # nobody waits on its chunks any more


def test_the_shared_chunk_is_at_most_the_largest():
    assert Scheduler(1, prefill_chunk=32, shared_chunk=128).shared_chunk == 32
    assert Scheduler(1, prefill_chunk=32).shared_chunk == 32
