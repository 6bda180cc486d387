"""Grammars compiled in a process of their own: a compile past its deadline or its memory cap refuses its request
and the next compile gets a fresh process; ordinary grammars and their errors come back as they would in-process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from runner.core.args import EngineArgs
from runner.core.engine import LLMEngine
from runner.llm import LLM
from runner.sampling.compile_process import CompileProcess, GrammarBusy
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
    assert first.poll() is not None  # killed, and a fresh one started for the next grammar
    assert engine._grammars._process._process not in (None, first)
    assert requests_for(engine, StructuredOutputs(json=name))  # kept from before: no process needed
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


def test_a_compile_that_waits_its_whole_deadline_for_its_turn_is_refused_as_busy(engine_factory):
    engine = LLMEngine(EngineArgs(engine_factory("gqa")))
    process = CompileProcess(
        engine.artifact.path(engine.manifest.tokenizer.file), engine.manifest.model.vocab_size, [0], 0.5, 512
    )
    try:
        assert process.compile("regex", "[0-9]+")  # started and ready
        with process._lock:  # another request's compile holds the process
            with pytest.raises(GrammarBusy, match="longer than 0.5 s"):
                process.compile("regex", "[a-z]+")
        assert process.compile("regex", "[a-z]+")
    finally:
        process._stop()


def test_a_script_without_a_main_guard_can_use_the_compile_process(engine_factory, tmp_path):
    """The process runs this package's module, not the caller's script again (as multiprocessing's spawn would)."""
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            f"""
            from runner.llm import LLM
            from runner.sampling.params import SamplingParams
            from runner.sampling.structured import StructuredOutputs

            llm = LLM({str(engine_factory("gqa"))!r}, grammar_timeout=30.0)
            spec = StructuredOutputs(choice=["yes"])
            output = llm.generate(["hi"], SamplingParams(max_tokens=4, structured_outputs=spec))[0].outputs[0]
            print("answer:", output.text)
            """
        )
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("answer: yes") == 1, result.stdout
