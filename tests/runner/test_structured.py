"""Structured outputs: every token the grammar's matcher allows, nothing else, whatever the sampling does."""

from __future__ import annotations

import json
import re

import pytest

from runner.llm import LLM
from runner.llm_engine import LLMEngine
from runner.sampling import SamplingParams
from runner.structured import GrammarError, StructuredOutputs

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (scripts/test.sh installs it)")

PHONE = r"\(0[1-9]\) [0-9]{3}-[0-9]{2}"


def test_sampled_outputs_always_match_a_regex_and_keep_their_randomness(engine_factory):
    """A random tiny model never writes this pattern by itself; at temperature 1 with top-p, 12 seeded samples all
    match it in full, end with the pattern (stop) and differ among themselves."""
    llm = LLM(engine_factory("gqa"))
    params = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.95, seed=5, n=12,
                            structured_outputs=StructuredOutputs(regex=PHONE))
    outputs = llm.generate("The quick brown fox", params)[0].outputs
    assert all(re.fullmatch(PHONE, o.text) and o.finish_reason == "stop" for o in outputs), [o.text for o in outputs]
    assert len({o.text for o in outputs}) > 3
    unconstrained = llm.generate("The quick brown fox", SamplingParams(max_tokens=12, temperature=1.0, seed=5))[0]
    assert not re.fullmatch(PHONE, unconstrained.text)


def test_choice_and_json_on_plain_and_speculative_engines(engine_factory):
    """Greedy or sampled, plain or speculative (a constrained row gets no drafts), each answer is one of the choices,
    and JSON answers that end parse and follow the schema."""
    choices = ["alpha", "beta gamma", "delta"]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    for engine in (engine_factory("gqa"), engine_factory("gqa", speculative="prompt-lookup")):
        llm = LLM(engine, speculative_max_rows=None)
        for temperature in (0.0, 1.0):
            outs = llm.generate(["hello hello hello", "The quick brown"], SamplingParams(
                max_tokens=16, temperature=temperature, seed=3, structured_outputs=StructuredOutputs(choice=choices)))
            assert all(o.text in choices and o.finish_reason == "stop" for o in outs), [o.text for o in outs]
        outs = [o for result in llm.generate(["hello", "The quick brown"], SamplingParams(
            max_tokens=60, temperature=1.0, seed=1, n=4, structured_outputs=StructuredOutputs(json=schema)))
            for o in result.outputs]
        finished = [json.loads(o.text) for o in outs if o.finish_reason == "stop"]
        assert finished and all(set(value) == {"ok"} and isinstance(value["ok"], bool) for value in finished)
        stats = llm.engine.speculation_stats
        if llm.engine.speculation is not None:  # verified, never drafted: one token per verify step
            assert stats.verify_steps > 0 and stats.accepted_histogram.keys() == {0}


def test_bad_specs_are_refused(engine_factory):
    engine = LLMEngine(engine_factory("gqa"))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputs(regex="a+"))
    with pytest.raises(GrammarError, match="Unclosed"):
        engine.new_requests("hi", None, SamplingParams(structured_outputs=StructuredOutputs(regex="[0-9")))
    with pytest.raises(GrammarError, match="cannot compile"):
        engine.new_requests("hi", None, SamplingParams(structured_outputs=StructuredOutputs(json={"type": "no-such-type"})))
