"""step_tokens on a tiny engine: the feeds it builds must be a valid causal step of 1 .. 16 tokens after a cached
context, and every token count must run."""

import numpy as np

from benchmarks.step_tokens import TOKENS, bound_steps, measure, step_feeds, step_session
from engines.format import open_artifact


def test_a_step_of_each_token_count_runs_and_is_timed(engine_factory):
    times = measure(engine_factory(quant="int4"), threads=1, context=70, repeats=1)["engine"]
    assert list(times) == TOKENS and all(ms > 0 for ms in times.values())


def test_an_int8_cache_engine_is_timed_over_an_int8_cache(engine_factory):
    """The cache buffers take the graph's dtype: an int8 KV cache is fed int8 zeros (float ones fail the call)."""
    engine = engine_factory(quant="int4", kv_cache_dtype="int8")
    times = measure(engine, threads=1, context=20, repeats=1)["engine"]
    assert list(times) == TOKENS and all(ms > 0 for ms in times.values())


def test_decode_steps_of_several_rows_are_timed_beside_the_token_counts(engine_factory):
    times = measure(engine_factory(quant="int4"), threads=1, context=9, repeats=1, rows=(2, 8))["engine"]
    assert list(times) == [*TOKENS, "2 rows", "8 rows"] and all(ms > 0 for ms in times.values())


def test_the_rows_of_a_decode_batch_each_follow_the_context(engine_factory):
    session = step_session(open_artifact(engine_factory()), threads=1, spinning=False)
    graph, inputs, outputs = bound_steps(session, context=5, rows=(3,))["3 rows"]
    assert inputs["input_ids"].shape == (3, 1) and inputs["positions"].tolist() == [[5]] * 3
    graph.run(inputs, outputs)
    keys = graph.buffers["past_key.0"]
    assert keys.shape[0] == 3 and all(np.abs(keys[r, :, 5]).sum() > 0 and not keys[r, :, 6:].any() for r in range(3))
    assert outputs["argmax"].shape == (3, 1)


def test_another_kernel_library_runs_the_same_graph(engine_factory, tmp_path):
    from plugins import native_ops

    library = native_ops.compile_library(tmp_path)
    curves = measure(engine_factory(quant="int4"), threads=1, context=3, repeats=1, libraries=[library])
    assert list(curves) == [str(library)] and list(curves[str(library)]) == TOKENS


def test_the_cache_is_bound_in_place_as_the_runner_binds_it(engine_factory):
    session = step_session(open_artifact(engine_factory()), threads=1, spinning=False)
    graph, inputs, outputs = bound_steps(session, context=5)[3]
    graph.run(inputs, outputs)
    keys = graph.buffers["past_key.0"]
    assert keys is graph.buffers["present_key.0"]
    assert np.abs(keys[0, :, 5:8]).sum() > 0 and not keys[0, :, :5].any() and not keys[0, :, 8:].any()


def test_the_feeds_are_a_causal_step_after_the_context(engine_factory):
    import onnxruntime as ort

    from engines.backends.onnxruntime import register_native_libraries, session_options
    from engines.format import open_artifact

    artifact = open_artifact(engine_factory())
    options = session_options(ort, 1, spinning=False)
    register_native_libraries(options, artifact)
    session = ort.InferenceSession(str(artifact.path(artifact.manifest.graphs["step"].file)), options)
    feeds = step_feeds(session, tokens=3, context=61)
    assert feeds["attention_bias"].shape == (1, 1, 3, 64)
    assert (feeds["attention_bias"][0, 0, :, :61] == 0).all()  # the context is visible to every new token
    assert np.isinf(feeds["attention_bias"][0, 0, 0, 62:]).all() and feeds["attention_bias"][0, 0, 2, 63] == 0
    assert feeds["past_key.0"].shape[2] == 64 and feeds["positions"].tolist() == [[61, 62, 63]]
    session.run(["argmax"], feeds)
