"""step_tokens on a tiny engine: the feeds it builds must be a valid causal step of 1 .. 16 tokens after a cached
context, and every token count must run."""

import numpy as np

from benchmarks.step_tokens import TOKENS, measure, step_feeds


def test_a_step_of_each_token_count_runs_and_is_timed(engine_factory):
    times = measure(engine_factory(quant="int4"), threads=1, context=70, repeats=1)
    assert list(times) == TOKENS and all(ms > 0 for ms in times.values())


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
