"""Structured outputs: every token the grammar's matcher allows, nothing else, whatever the sampling does."""

from __future__ import annotations

import json
import re

import pytest

from runner.core.args import EngineArgs
from runner.core.engine import LLMEngine
from runner.llm import LLM
from runner.sampling.params import SamplingParams
from runner.sampling.structured import GrammarError, StructuredOutputs, json_schema_satisfiable

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (scripts/test.sh installs it)")

PHONE = r"\(0[1-9]\) [0-9]{3}-[0-9]{2}"


def test_sampled_outputs_always_match_a_regex_and_keep_their_randomness(engine_factory):
    """A random tiny model never writes this pattern by itself; at temperature 1 with top-p, 12 seeded samples all
    match it in full, end with the pattern (stop) and differ among themselves."""
    llm = LLM(engine_factory("gqa"))
    params = SamplingParams(
        max_tokens=40, temperature=1.0, top_p=0.95, seed=5, n=12, structured_outputs=StructuredOutputs(regex=PHONE)
    )
    outputs = llm.generate("The quick brown fox", params)[0].outputs
    assert all(re.fullmatch(PHONE, o.text) and o.finish_reason == "stop" for o in outputs), [o.text for o in outputs]
    assert len({o.text for o in outputs}) > 3
    unconstrained = llm.generate("The quick brown fox", SamplingParams(max_tokens=12, temperature=1.0, seed=5))[0]
    assert not re.fullmatch(PHONE, unconstrained.text)


def test_choice_and_json_on_plain_and_speculative_engines(engine_factory):
    """Greedy or sampled, plain or speculative, each answer is one of the choices, and JSON answers that end parse
    and follow the schema."""
    choices = ["alpha", "beta gamma", "delta"]
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    for engine in (engine_factory("gqa"), engine_factory("gqa", speculative="prompt-lookup")):
        llm = LLM(engine, speculative_max_rows=None)
        for temperature in (0.0, 1.0):
            outs = llm.generate(
                ["hello hello hello", "The quick brown"],
                SamplingParams(
                    max_tokens=16, temperature=temperature, seed=3, structured_outputs=StructuredOutputs(choice=choices)
                ),
            )
            assert all(o.text in choices and o.finish_reason == "stop" for o in outs), [o.text for o in outs]
        outs = [
            o
            for result in llm.generate(
                ["hello", "The quick brown"],
                SamplingParams(
                    max_tokens=60, temperature=1.0, seed=1, n=4, structured_outputs=StructuredOutputs(json=schema)
                ),
            )
            for o in result.outputs
        ]
        finished = [json.loads(o.text) for o in outs if o.finish_reason == "stop"]
        assert finished and all(set(value) == {"ok"} and isinstance(value["ok"], bool) for value in finished)


def test_speculative_engines_draft_constrained_requests_with_a_mask_per_tree_node(engine_factory):
    """A model drafting for itself under the grammar's (or the bad words') masks, its drafts verified with each
    node's own mask: greedy answers are the plain engine's, nearly every draft is accepted, and sampled answers
    still match the grammar."""
    plain = LLM(engine_factory("gqa"))
    spec = LLM(
        engine_factory("gqa", prefill_chunk=8, draft_model="gqa", draft_len=3, draft_quant="none"),
        speculative_max_rows=None,
        max_verify_nodes=None,  # whole trees for both rows
    )
    prompts = ["hello hello hello", "The quick brown fox"]
    pattern = r"[^0-9]{0,30}[0-9]"
    for mask in (
        {"structured_outputs": StructuredOutputs(regex=pattern)},
        {
            "bad_words": [
                plain.tokenizer.decode([t])
                for t in plain.generate(prompts[0], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[
                    0
                ].token_ids[2:4]
            ]
        },
    ):
        greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos="bad_words" in mask, **mask)
        assert [o.token_ids for o in spec.generate(prompts, greedy)] == [
            o.token_ids for o in plain.generate(prompts, greedy)
        ]
    # the draft model drafts its greedy answer under the same masks: the target (the same weights) accepts it whole
    histogram = spec.engine.speculation_stats.accepted_histogram
    assert histogram.get(3, 0) >= 0.8 * sum(histogram.values()), histogram
    sampled = spec.generate(
        prompts,
        SamplingParams(
            max_tokens=40, temperature=1.0, seed=4, n=4, structured_outputs=StructuredOutputs(regex=pattern)
        ),
    )
    texts = [o.text for result in sampled for o in result.outputs if o.finish_reason == "stop"]
    assert texts and all(re.fullmatch(pattern, t) for t in texts)


def test_bad_specs_are_refused(engine_factory):
    engine = LLMEngine(EngineArgs(engine_factory("gqa")))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputs(regex="a+"))
    with pytest.raises(GrammarError, match="Unclosed"):
        engine.new_requests("hi", None, SamplingParams(structured_outputs=StructuredOutputs(regex="[0-9")))
    with pytest.raises(GrammarError, match="cannot compile"):
        engine.new_requests(
            "hi", None, SamplingParams(structured_outputs=StructuredOutputs(json={"type": "no-such-type"}))
        )
    for schema in ({"$ref": "#"}, MUTUAL):  # no finite value: refused when compiled, not once generation started
        with pytest.raises(GrammarError, match="no finite JSON value"):
            engine.new_requests("hi", None, SamplingParams(structured_outputs=StructuredOutputs(json=schema)))
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputs(choice="abc")


# definitions that require each other: A needs a B, which needs an A
MUTUAL = {
    "$ref": "#/$defs/A",
    "$defs": {
        "A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}}, "required": ["b"]},
        "B": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]},
    },
}
TREE = {  # recursive, with a way out: an empty list of children
    "$ref": "#/$defs/T",
    "$defs": {
        "T": {
            "type": "object",
            "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/T"}}},
            "required": ["kids"],
        }
    },
}


@pytest.mark.parametrize(
    "schema, satisfiable",
    [
        ({"$ref": "#"}, False),
        (MUTUAL, False),
        (json.dumps(MUTUAL), False),
        (TREE, True),
        ({"type": "object", "properties": {"next": {"$ref": "#"}}}, True),  # optional: it may be left out
        ({"anyOf": [{"$ref": "#"}, {"type": "null"}]}, True),
        ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, False),
        ({"type": "array", "items": {"$ref": "#"}}, True),
        ({"type": "string", "enum": []}, False),
        ({"allOf": [{"type": "string"}, False]}, False),
        ({"$ref": "https://example.com/schema.json"}, True),  # what it cannot see it takes as satisfiable
        ({"type": ["null", "object"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, True),
    ],
)
def test_json_schema_satisfiability(schema, satisfiable):
    assert json_schema_satisfiable(schema) is satisfiable
