"""Tensor-parallel engines run by rank processes (runner/core/tensor_parallel.py): the same tokens as the single-rank
engine of the same weights, the features of the runner on top, and a rank's failure an error, never a hang."""

from __future__ import annotations

import glob
import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from engines.format import open_artifact
from plugins import native_ops
from runner import LLM, SamplingParams
from runner.core.args import EngineArgs
from runner.core.engine import LLMEngine
from runner.core.shared_segment import DEFAULT_TIMEOUT_S
from runner.core.tensor_parallel import RankFailure, threads_per_rank
from runner.sampling.structured import StructuredOutputs
from runner.tools.info import describe

pytestmark = pytest.mark.skipif(
    native_ops.unavailable_reason() is not None,
    reason="the collectives are in our kernel library, which cannot be built here",
)
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "hello hello hello world", "a b c d e f g"]


def tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    ids = [llm.tokenizer.encode(p) for p in prompts]
    return [out.token_ids for out in llm.generate(prompt_token_ids=ids, sampling_params=params)]


@pytest.mark.parametrize(
    "name, options",
    [
        ("gqa", {}),
        ("three_kv_heads", {}),
        # fp32 activations: a one-row call rounds differently here, so every rank pads it to two (min_rows)
        ("three_kv_heads", {"quant": "int4", "int8_compute": False}),
        # untied: each rank stores the whole embedding table in the same int4 blocks as the single-rank engine
        ("untied_bias", {"quant": "int4", "int8_compute": False}),
    ],
)
def test_two_ranks_give_the_single_rank_engines_greedy_tokens_alone_and_batched(engine_factory, name, options):
    single, sharded = LLM(engine_factory(name, **options)), LLM(engine_factory(name, tensor_parallel=2, **options))
    expected = tokens(single)
    assert tokens(sharded) == expected  # batched: three rows in one call
    assert [tokens(sharded, [p])[0] for p in PROMPTS] == expected  # alone


def test_logits_match_the_single_rank_engine(engine_factory):
    prompt = list(range(5, 35))  # within one prompt chunk
    single = LLMEngine(EngineArgs(engine_factory("three_kv_heads")))
    sharded = LLMEngine(EngineArgs(engine_factory("three_kv_heads", tensor_parallel=2)))
    a, b = single.executor.prefill(0, prompt, 0), sharded.executor.prefill(0, prompt, 0)
    # the row-parallel sums add the ranks' partial products in another order than one matmul does
    np.testing.assert_allclose(b.logits, a.logits, rtol=0, atol=1e-4)
    decoded_a = single.executor.decode([0], [7], [len(prompt)])
    decoded_b = sharded.executor.decode([0], [7], [len(prompt)])
    np.testing.assert_allclose(decoded_b.logits, decoded_a.logits, rtol=0, atol=1e-4)
    assert decoded_b.argmax.tolist() == decoded_a.argmax.tolist()


def test_an_int8_kv_cache_takes_the_whole_models_scales_on_every_rank(engine_factory):
    """Calibrated on the whole model as the single-rank build calibrates them, each rank holding its KV heads'
    scales: the single-rank engine's scales and greedy tokens, batched and alone."""
    import onnx
    from onnx import numpy_helper

    def scales(engine, file):
        graph = onnx.load(str(engine / file), load_external_data=False).graph
        return {i.name: numpy_helper.to_array(i) for i in graph.initializer if i.name.endswith(("k_scale", "v_scale"))}

    single = engine_factory("three_kv_heads", kv_cache_dtype="int8")
    sharded = engine_factory("three_kv_heads", kv_cache_dtype="int8", tensor_parallel=2)
    manifest = open_artifact(sharded).manifest
    whole, ranks = scales(single, "model.onnx"), [scales(sharded, s.graph.file) for s in manifest.shards]
    assert len(whole) == 4 and all(rank.keys() == whole.keys() for rank in ranks)
    for name, value in whole.items():
        np.testing.assert_array_equal(np.concatenate([rank[name] for rank in ranks], axis=1), value)
    assert manifest.quantization.kv_cache is not None and manifest.quantization.kv_cache.dtype == "int8"
    expected = tokens(LLM(single))
    sharded_llm = LLM(sharded)
    assert tokens(sharded_llm) == expected
    assert [tokens(sharded_llm, [p])[0] for p in PROMPTS] == expected


@pytest.mark.parametrize("name", ["three_kv_heads", "untied_bias"])
def test_gptq_runs_on_the_whole_model_and_each_rank_takes_its_share(engine_factory, name):
    """Each rank's blocks (and embedding table: the tied head's, or its own) are the whole model's GPTQ blocks
    cut to its share: the single-rank GPTQ engine's greedy tokens, batched and alone (fp32 activations, as above)."""
    options = {"quant": "gptq", "int8_compute": False}
    single, sharded = engine_factory(name, **options), engine_factory(name, tensor_parallel=2, **options)
    quantization = open_artifact(sharded).manifest.quantization
    assert quantization.method == "gptq" and quantization.gptq is not None
    expected = tokens(LLM(single))
    sharded_llm = LLM(sharded)
    assert tokens(sharded_llm) == expected
    assert [tokens(sharded_llm, [p])[0] for p in PROMPTS] == expected


def test_the_manifest_lists_each_ranks_share_and_graph(engine_factory):
    manifest = open_artifact(engine_factory("three_kv_heads", tensor_parallel=2)).manifest
    assert manifest.tensor_parallel == 2 and [s.rank for s in manifest.shards] == [0, 1]
    shares = [(s.kv_heads, s.heads, s.vocab) for s in manifest.shards]
    assert shares == [([0, 2], [0, 4], [0, 160]), ([2, 3], [4, 6], [160, 320])]
    assert manifest.shards[1].graph.file in manifest.files and "AllReduce" in manifest.shards[1].graph.native_ops
    assert manifest.for_rank(1).kv_cache.num_kv_heads == 1 and manifest.for_rank(0).kv_cache.num_kv_heads == 2
    described = "\n".join(describe(open_artifact(engine_factory("three_kv_heads", tensor_parallel=2))))
    assert "rank 1: model.rank1.onnx, KV heads 2..2, heads 4..5, MLP 64..95, vocabulary 160..319" in described


def test_prefix_caching_speculation_and_sampling_run_on_the_ranks(engine_factory):
    prompt = "one two three four five six seven eight nine ten " * 3
    seeded = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    results = []
    for tp in (1, 2):
        llm = LLM(engine_factory("gqa", speculative="prompt-lookup", tensor_parallel=tp), enable_prefix_caching=True)
        first = tokens(llm, [prompt])
        again = tokens(llm, [prompt + "ten"])  # starts after the cached prefix
        results.append((first, again, tokens(llm, [prompt], seeded)))
    assert results[1] == results[0]


def test_structured_outputs_run_on_the_ranks(engine_factory):
    pytest.importorskip("xgrammar")
    choice = StructuredOutputs(choice=["yes", "no", "maybe"])
    params = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=choice)
    single, sharded = LLM(engine_factory("gqa")), LLM(engine_factory("gqa", tensor_parallel=2))
    assert tokens(sharded, PROMPTS[:1], params) == tokens(single, PROMPTS[:1], params)


def test_a_rank_that_dies_stops_the_engine_with_an_error_and_leaves_nothing_behind(engine_factory):
    segments_before = set(glob.glob("/dev/shm/llm-engine-tp-*"))
    llm = LLM(engine_factory("gqa", tensor_parallel=2))
    tokens(llm, PROMPTS[:1])
    ranks = llm.engine.ranks
    assert set(glob.glob("/dev/shm/llm-engine-tp-*")) == segments_before  # unlinked once every rank attached
    os.kill(ranks.pids[0], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1"):
        tokens(llm, PROMPTS[:1])
    assert time.monotonic() - start < 5
    with pytest.raises(RankFailure):  # and every call after it
        tokens(llm, PROMPTS[:1])


def test_a_rank_that_hangs_stops_the_engine_with_an_error_after_the_collectives_timeout(engine_factory):
    llm = LLM(engine_factory("gqa", tensor_parallel=2))
    tokens(llm, PROMPTS[:1])
    rank = llm.engine.ranks.pids[0]
    os.kill(rank, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(RankFailure, match="did not reach a collective in time"):
            tokens(llm, PROMPTS[:1])
        assert time.monotonic() - start < DEFAULT_TIMEOUT_S + 5
    finally:
        os.kill(rank, signal.SIGCONT)


def test_an_error_of_rank_zeros_own_call_is_reported_as_it_is(engine_factory, monkeypatch):
    from runner.core.executor import Executor

    engine = LLMEngine(EngineArgs(engine_factory("gqa", tensor_parallel=2)))

    def failing_run(self, *args):
        raise RuntimeError("rank 0's own call failed")

    monkeypatch.setattr(Executor, "_run", failing_run)  # in this process only: rank 0's
    with pytest.raises(RuntimeError, match="rank 0's own call failed") as raised:
        engine.executor.prefill(0, [5, 6, 7], 0)
    assert not isinstance(raised.value, RankFailure) and engine.ranks.failure is None


def test_the_other_ranks_exit_when_rank_zero_is_gone(engine_factory, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "leader.py"
    script.write_text(
        "import sys\nfrom runner import LLM\n"
        f"llm = LLM({str(engine_factory('gqa', tensor_parallel=2))!r})\n"
        "print(*llm.engine.ranks.pids, flush=True)\nsys.stdin.read()\n"
    )
    leader = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pids = [int(pid) for pid in leader.stdout.readline().split()]
    leader.kill()
    leader.wait()
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "a rank outlived rank 0"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] == "Z"


def test_threads_are_shared_between_the_ranks():
    assert threads_per_rank(2, 3) == 3
    assert threads_per_rank(2, None) == max(1, len(os.sched_getaffinity(0)) // 2)


def test_an_engine_of_gguf_blocks_keeps_them_on_every_rank_and_gives_the_single_rank_tokens(
    checkpoint_factory, tmp_path
):
    pytest.importorskip("gguf")
    from builder.build import BuildOptions, build_engine
    from tests.tiny_checkpoint import make_gguf

    gguf = make_gguf(tmp_path / "tiny.gguf", checkpoint_factory("three_kv_heads"))
    engines = {}
    for tp in (1, 2):
        engines[tp] = tmp_path / f"tp{tp}"
        options = BuildOptions(
            str(gguf), engines[tp], max_seq_len=256, max_batch=4, prefill_chunk=32, tensor_parallel=tp
        )
        build_engine(options, log=lambda line: None)
    manifest = open_artifact(engines[2]).manifest
    assert manifest.quantization.method == "gguf-blocks" and "Int4MatMul" in manifest.shards[1].graph.native_ops
    assert tokens(LLM(engines[2])) == tokens(LLM(engines[1]))


def test_a_server_whose_rank_dies_fails_its_requests_and_reports_itself_unhealthy(engine_factory):
    import httpx
    import openai

    from tests.runner.serving.test_server import LiveServer, chat

    live = LiveServer(engine_factory("gqa", tensor_parallel=2))
    try:
        chat(live)
        os.kill(live.engine.engine.ranks.pids[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError, match="rank 1"):
            chat(live, max_tokens=64)
        assert time.monotonic() - start < 5
        health = httpx.get(f"{live.url}/health")
        assert health.status_code == 503 and "rank 1" in health.json()["error"]
        with pytest.raises(openai.APIStatusError, match="engine has stopped") as refused:
            chat(live)
        assert refused.value.status_code == 503
    finally:
        live.stop()


def test_a_rank_whose_socket_closed_before_its_process_exited_fails_the_group_for_good():
    """A killed rank's socket can refuse a call before its process is seen to exit. The group has failed then too:
    the aborts that follow (each frees a request's row on every rank) send nothing more and raise nothing, so the
    server's loop fails every request instead of dying with them unanswered."""
    zmq = pytest.importorskip("zmq")
    from runner.core.tensor_parallel import MirroredCache, RankGroup

    class ClosedSocket:
        def __init__(self) -> None:
            self.sends = 0

        def send(self, data, copy, flags):
            self.sends += 1
            raise zmq.Again()

    class StillRunning:
        def poll(self):
            return None

    class Segment:
        def __init__(self) -> None:
            self.marked = False

        def abort(self) -> None:
            self.marked = True

        def aborted(self) -> bool:
            return self.marked

    socket, freed = ClosedSocket(), []
    group = object.__new__(RankGroup)  # the group's state without its processes
    group._zmq, group.sockets, group.processes, group.pids = zmq, [socket], [StillRunning()], [os.getpid()]
    group.failure, group.segment = None, Segment()
    with pytest.raises(RankFailure, match="rank 1 takes no more calls"):
        group.send(("executor", "_run", ()))
    assert group.segment.aborted()  # the other ranks' collectives fail at once
    cache = type("Cache", (), {"free_row": lambda self, row: freed.append(row)})()
    MirroredCache(cache, group).free_row(3)
    assert freed == [3] and socket.sends == 1
    with pytest.raises(RankFailure, match="rank 1 takes no more calls"):
        group.check()


def test_runner_serve_stops_with_an_error_when_a_rank_dies(engine_factory):
    import subprocess
    import sys

    import httpx

    from tests.runner.serving.test_server import free_port

    port = free_port()
    command = [sys.executable, "-m", "runner.cli.main", "serve", str(engine_factory("gqa", tensor_parallel=2))]
    server = subprocess.Popen([*command, "--port", str(port)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline and server.poll() is None, "the server did not start"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        ranks = [int(pid) for pid in open(f"/proc/{server.pid}/task/{server.pid}/children").read().split()]
        assert len(ranks) == 1
        os.kill(ranks[0], signal.SIGKILL)
        model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30)
        assert server.wait(timeout=15) == 1
        assert "rank 1" in server.stderr.read()
    finally:
        server.kill()
        server.wait()


@pytest.mark.default_model
def test_the_default_model_on_two_ranks(default_engine, default_gguf_engine, tmp_path):
    """9 query / 3 KV heads split 6 + 3 / 2 + 1. fp32: the single-rank engine's greedy tokens. The GGUF's own blocks
    with int8 activations: summing a row-parallel matmul in two parts rounds differently, and int8 activations
    grow that through 30 layers (prefill logits within 1.5 of the single-rank engine's; greedy answers can part at a
    near tie, as the README question's first token does: 25.04 against 25.01)."""
    from builder.build import BuildOptions, build_engine

    engines = {}
    for name, quant in (("fp32", "none"), ("gguf", "auto")):
        engines[name] = tmp_path / name
        build_engine(BuildOptions("default", engines[name], quant=quant, tensor_parallel=2), log=lambda line: None)
    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
    single = LLM(default_engine)
    codec = single.engine.codec
    chats = [codec.encode(codec.apply_chat_template([{"role": "user", "content": p}])) for p in prompts]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    expected = [out.token_ids for out in single.generate(prompt_token_ids=chats, sampling_params=params)]
    sharded = LLM(engines["fp32"])
    assert [out.token_ids for out in sharded.generate(prompt_token_ids=chats, sampling_params=params)] == expected
    for prompt in chats:
        a = LLMEngine(EngineArgs(default_gguf_engine)).executor.prefill(0, prompt, 0)
        b = LLMEngine(EngineArgs(engines["gguf"])).executor.prefill(0, prompt, 0)
        assert np.abs(a.logits - b.logits).max() < 1.5


@pytest.mark.parametrize("processes", [2, 3])
def test_mpirun_starts_the_ranks_and_a_wrong_count_is_refused(engine_factory, tmp_path, processes):
    import shutil
    import subprocess
    import sys

    pytest.importorskip("mpi4py")
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("no mpiexec here (pip install mpich)")
    engine = engine_factory("gqa", tensor_parallel=2)
    script = tmp_path / "generate.py"
    script.write_text(
        "import json\nfrom runner import LLM, SamplingParams\n"
        f"llm = LLM({str(engine)!r})\n"  # ranks 1.. serve rank 0 from here and exit when it is done
        f"ids = llm.tokenizer.encode({PROMPTS[0]!r})\n"
        "params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)\n"
        "print(json.dumps(llm.generate(prompt_token_ids=[ids], sampling_params=params)[0].token_ids))\n"
    )
    root = str(Path(__file__).resolve().parents[3])  # this checkout, whatever the environment has installed
    run = subprocess.run(
        [mpiexec, "-n", str(processes), sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": root},
    )
    if processes == 3:
        assert run.returncode != 0 and "this engine has 2 tensor-parallel ranks; it was launched with 3" in run.stderr
        return
    assert run.returncode == 0, run.stderr[-2000:]
    assert [json.loads(line) for line in run.stdout.splitlines()] == tokens(LLM(engine_factory("gqa")), PROMPTS[:1])


def test_a_redrafter_engine_drafts_on_rank_zero_and_verifies_on_every_rank(engine_factory, tiny_draft_head):
    single = LLM(engine_factory("gqa", draft_head=tiny_draft_head[0]))
    sharded = LLM(engine_factory("gqa", draft_head=tiny_draft_head[0], tensor_parallel=2))
    assert tokens(sharded) == tokens(single)
    assert sharded.engine.speculation_stats.verify_steps > 0
