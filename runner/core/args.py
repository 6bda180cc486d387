"""How to open and run an engine artifact, in one typed place (vLLM's EngineArgs): the Python API, the command line
and the server all build an EngineArgs and hand it to LLMEngine. What can be checked without the engine is checked
here; limits that depend on the engine (its rows, its max_seq_len) are checked when it opens."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path

# Speculate only while one row generates: verification costs compute that batching already uses, so under load
# plain steps are faster (docs/measurements.md).
DEFAULT_SPECULATIVE_MAX_ROWS = "auto"
# While requests generate, a prompt goes in chunks of this many tokens: they wait for each chunk, and a short chunk
# keeps that wait short (docs/measurements.md).
DEFAULT_SHARED_PREFILL_CHUNK = 128
# A step of plain greedy rows with nothing else to do makes up to this many decode calls in a row: the engine's
# Python between two calls is then paid once per burst, but tokens stream in groups of this many and a request that
# arrives meanwhile waits for the burst to end (docs/measurements.md).
DEFAULT_NUM_SCHEDULER_STEPS = 8


class GenerationConfig(str, Enum):
    """Where the defaults of what a request leaves unset come from (vLLM's --generation-config)."""

    AUTO = "auto"  # the sampling parameters the model recommends (the manifest's sampling_defaults)
    VLLM = "vllm"  # vLLM's own SamplingParams defaults

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class EngineArgs:
    """`model`: the engine directory (vLLM's name for what to load).
    `threads`: onnxruntime's intra-op threads (None: its default, one per core).
    `max_batch`: rows decoded together, at most the engine's largest decode bucket (None: that bucket).
    `enable_prefix_caching`: a prompt starts after the longest prefix whose K/V a cache row holds from an earlier or
    running request (runner/core/prefix_cache.py).
    `speculative_max_rows`: "auto": a speculative engine verifies drafts in a step where its measured step times
    say that emits more tokens per second than a plain decode step (runner/speculative/policy.py); N: in steps with
    at most N generating rows; None: in every step (whose trees have room for a draft, see `max_verify_nodes`).
    `chat_template`: a Jinja chat template used instead of the artifact's (vLLM's --chat-template).
    `generation_config`: see GenerationConfig.
    `max_model_len`: serve shorter sequences (prompt + output) than the engine was built for (vLLM's flag).
    `max_verify_nodes`: a speculative engine's draft trees have at most this many nodes, root included (None: as
    many as the engine was built for; "auto": the rows verified together share the tokens the target's matmul kernel
    takes in one pass over the weights on this CPU where that is measured to pay, see engine.matmul_rows_per_pass:
    one row's tree has them all, two rows' trees half each, and a step whose trees would have no room for a draft
    decodes plain).
    `shared_prefill_chunk`: prompt tokens per step while other requests generate (they wait for each chunk), at most
    the engine's largest chunk, which a prompt takes while none does (None: always the largest).
    `num_scheduler_steps`: the most decode calls a step makes in a row where every row is a plain greedy one and
    nothing else waits (vLLM's flag of that name; 1: one call per step).
    `grammar_timeout`: seconds a structured output's grammar may take to compile, in a process of its own that is
    killed past them (or past GRAMMAR_MEMORY_MIB), which refuses the request (a pathological schema compiles for
    minutes); None (the default here, for schemas the caller wrote): compile in this process, without a limit.
    `runner serve` and `runner run-batch` set 10 s (`--grammar-timeout`), since their clients may be anyone.
    `profile_prefix`: write onnxruntime's per-node trace with this prefix (runner profile)."""

    model: str | Path
    threads: int | None = None
    verify_checksums: bool = True
    max_batch: int | None = None
    enable_prefix_caching: bool = False
    speculative_max_rows: int | str | None = DEFAULT_SPECULATIVE_MAX_ROWS
    chat_template: str | None = None
    generation_config: GenerationConfig = GenerationConfig.AUTO
    max_model_len: int | None = None
    max_verify_nodes: int | str | None = "auto"
    shared_prefill_chunk: int | None = DEFAULT_SHARED_PREFILL_CHUNK
    num_scheduler_steps: int = DEFAULT_NUM_SCHEDULER_STEPS
    grammar_timeout: float | None = None
    profile_prefix: str | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "generation_config", GenerationConfig(self.generation_config))
        except ValueError:
            raise ValueError(f"generation_config must be 'auto' or 'vllm', not {self.generation_config!r}") from None
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1 (or None: onnxruntime's default), got {self.threads}")
        if self.grammar_timeout is not None and not self.grammar_timeout > 0:
            raise ValueError(f"grammar_timeout must be > 0 seconds (or None: no limit), got {self.grammar_timeout}")
        if self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be >= 1, got {self.num_scheduler_steps}")
        if self.shared_prefill_chunk is not None and self.shared_prefill_chunk < 1:
            raise ValueError(
                "shared_prefill_chunk must be >= 1 (or None: the engine's largest chunk), "
                f"got {self.shared_prefill_chunk}"
            )
        rows = self.speculative_max_rows
        if rows != "auto" and rows is not None and (not isinstance(rows, int) or rows < 1):
            raise ValueError(f"speculative_max_rows must be 'auto', >= 1 or None (every step), got {rows!r}")
        nodes = self.max_verify_nodes
        if nodes != "auto" and nodes is not None and (not isinstance(nodes, int) or nodes < 2):
            raise ValueError(f"max_verify_nodes must be >= 2, 'auto' or None (the engine's trees whole), got {nodes}")
