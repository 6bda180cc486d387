"""Grammars compiled in a process of their own: a compile past its deadline or its memory cap refuses its request
and the next compile gets a fresh process; ordinary grammars and their errors come back as they would in-process."""

from __future__ import annotations

import pytest

from runner.core.args import EngineArgs
from runner.core.engine import LLMEngine
from runner.llm import LLM
from runner.sampling.params import SamplingParams
from runner.sampling.structured import GrammarError, StructuredOutputs

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (scripts/test.sh installs it)")


def optional_properties(count: int) -> dict:
    """A schema whose grammar explodes: xgrammar writes a rule for every suffix of the optional properties, and
    compiles a few thousand of them for seconds to minutes, whatever the vocabulary."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(count)}}


def requests_for(engine: LLMEngine, spec: StructuredOutputs):
    return engine.new_requests("hi", None, SamplingParams(max_tokens=4, structured_outputs=spec))


def test_a_compile_past_its_deadline_is_refused_and_the_next_gets_a_fresh_process(engine_factory):
    """(A grammar compiled before is kept by the caller and needs no process.)"""
    llm = LLM(engine_factory("gqa"), grammar_timeout=1.0)
    engine = llm.engine
    name = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    assert requests_for(engine, StructuredOutputs(json=name))  # starts the process: its start is not the deadline's
    first = engine._grammars._process._process
    with pytest.raises(GrammarError, match="took longer than 1 s"):
        requests_for(engine, StructuredOutputs(json=optional_properties(4000)))
    assert not first.is_alive()
    assert requests_for(engine, StructuredOutputs(json=name))  # kept from before: no process needed
    assert engine._grammars._process._process is None
    result = llm.generate(["hi"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(choice=["no"])))
    assert result[0].outputs[0].text == "no"
    with pytest.raises(GrammarError, match="Unclosed"):  # xgrammar's own errors pass through as before
        requests_for(engine, StructuredOutputs(regex="[0-9"))


def test_a_compile_past_its_memory_cap_is_refused(engine_factory):
    from runner.sampling.structured import GrammarCompiler

    engine = LLMEngine(EngineArgs(engine_factory("gqa")))
    manifest = engine.manifest
    compiler = GrammarCompiler(
        engine.artifact.path(manifest.tokenizer.file),
        manifest.model.vocab_size,
        sorted(manifest.model.eos_token_ids),
        timeout=120.0,
        memory_mib=64,
    )
    words = "|".join(f"word{i}" for i in range(50_000))  # ~0.3 GB and ~20 s to compile: a 0.5 MB body
    with pytest.raises(GrammarError, match="needed more than 64 MiB"):
        compiler.constraint(StructuredOutputs(regex=words))
    assert compiler.constraint(StructuredOutputs(regex="[0-9]+")).allowed().any()


def test_without_a_timeout_grammars_compile_in_this_process(engine_factory):
    engine = LLMEngine(EngineArgs(engine_factory("gqa"), grammar_timeout=None))
    assert requests_for(engine, StructuredOutputs(choice=["yes", "no"]))
    assert engine._grammars._process is None
