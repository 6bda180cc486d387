"""Lightweight runner: load an engine artifact and generate (Python API, CLI, server)."""

from runner.core.args import EngineArgs
from runner.core.request import CompletionOutput, FinishReason, RequestOutput
from runner.llm import LLM
from runner.sampling.params import SamplingParams
from runner.sampling.structured import StructuredOutputs

__all__ = [
    "LLM",
    "EngineArgs",
    "CompletionOutput",
    "FinishReason",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputs",
]
