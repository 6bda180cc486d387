"""Lightweight runner: load an engine artifact and generate (Python API, CLI, server)."""

from runner.llm import LLM
from runner.request import CompletionOutput, RequestOutput
from runner.sampling import SamplingParams
from runner.structured import StructuredOutputs

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputs"]
