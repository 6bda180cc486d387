"""`runner bench`'s measurements on tiny engines: weight bytes per step (checked against the ONNX initializers),
batch decode rates, the benchmark prompts and the memory-bandwidth probe."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest

from runner.core.args import EngineArgs
from runner.core.engine import LLMEngine
from runner.core.machine import memory_bandwidth_gbs
from runner.tools.bench import chat_prompts, generation_batch_sizes, time_batch_decode, weight_bytes_per_step


def initializer_bytes_read_per_step(engine_dir) -> int:
    """Independent count: every initializer of the graph stored in its weights file (inline ones are a few norm
    vectors and scalars), except a table only looked up by the step's token ids (embedding rows), directly or
    reshaped."""
    model = onnx.load(str(engine_dir / "model.onnx"), load_external_data=False)
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def looked_up(name: str) -> bool:
        def by_token(node) -> bool:
            if node.op_type == "Reshape" and node.input[0] == name:
                return looked_up(node.output[0])
            return node.op_type == "Gather" and list(node.input) == [name, "input_ids"]

        return bool(consumers.get(name)) and all(by_token(node) for node in consumers[name])

    total = 0
    for init in model.graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL or looked_up(init.name):
            continue
        total += math.prod(init.dims) * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type)).itemsize
    return total


@pytest.mark.parametrize("name, quant", [("gqa", "none"), ("gqa", "int8"), ("mqa", "none"), ("mqa", "int4")])
def test_weight_bytes_per_step_match_the_initializers_a_step_reads(engine_factory, name, quant):
    engine_dir = engine_factory(name, quant=quant)
    counted = weight_bytes_per_step(LLMEngine(EngineArgs(engine_dir)))
    expected = initializer_bytes_read_per_step(engine_dir)
    # the weights file's alignment is the difference
    assert expected * 0.98 <= counted <= expected


def test_batch_decode_counts_one_token_per_row_and_step(engine_factory):
    engine = LLMEngine(EngineArgs(engine_factory("gqa")))
    assert generation_batch_sizes(engine) == [1, 2, 4]
    ids = engine.codec.encode("hello there")
    for batch in (1, 3):
        rate = time_batch_decode(engine, ids, batch, new_tokens=6)
        assert rate.batch == batch
        assert rate.decode_tok_s == pytest.approx(batch * rate.steps_per_s)
    assert not engine.scheduler.running  # every request finished and freed its row
    with pytest.raises(ValueError, match="too few at batch 4"):
        time_batch_decode(engine, ids, 4, new_tokens=2)  # row 1 is done before row 4 has its first token
    assert not engine.scheduler.running


def test_benchmark_prompts(engine_factory):
    codec = LLMEngine(EngineArgs(engine_factory("gqa"))).codec
    prompts = chat_prompts(codec, long_tokens=200)
    assert set(prompts) == {"short", "long"} and len(prompts["long"]) >= 200
    assert "Summarise this text:" in codec.decode(prompts["long"])
    assert codec.decode(prompts["short"]).count("What is the capital of France?") == 1
    raw = chat_prompts(codec, long_tokens=0, question="hello", chat=False)
    assert raw == {"short": codec.encode("hello")}


def test_memory_bandwidth_is_a_plausible_rate():
    rate = memory_bandwidth_gbs(threads=2, megabytes=32, repeats=3)
    assert 0.5 < rate < 2000
