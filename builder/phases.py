"""The fixed shapes an engine serves: prefill chunks, decode batch x KV-length buckets, and the verify shape."""

from __future__ import annotations

from dataclasses import dataclass

from engines.format import PhaseSpec

STEP_GRAPH = "step"

# A prompt computed while no other request generates goes through in chunks of up to this many tokens: each chunk
# reads every weight once, so fewer chunks cost less where weights are large (docs/measurements.md). While other
# requests generate, the runner cuts chunks smaller (EngineArgs.shared_prefill_chunk).
DEFAULT_PREFILL_CHUNK = 1024
# ... except over an int8 KV cache: our attention kernel takes prompt chunks of up to 128 tokens there, and
# onnxruntime's, which takes longer ones, is slower and slows down with the chunk's length
DEFAULT_PREFILL_CHUNK_INT8_KV = 128
# score calls return logits at every position (128 x a 49k vocabulary: 25 MB in fp32), so their chunks stay small
SCORE_CHUNK = 128


def default_prefill_chunk(kv_cache_dtype: str, max_seq_len: int) -> int:
    return min(DEFAULT_PREFILL_CHUNK_INT8_KV if kv_cache_dtype == "int8" else DEFAULT_PREFILL_CHUNK, max_seq_len)


@dataclass(frozen=True)
class BuildShapes:
    max_seq_len: int = 2048
    max_batch: int = 8
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    verify_tokens: int = 8  # the largest token tree per row (root + drafts), for speculative verification
    min_past_len: int = 64

    def __post_init__(self) -> None:
        if self.max_seq_len < self.min_past_len:
            raise ValueError(f"--max-seq-len must be at least {self.min_past_len}")
        if self.max_batch < 1:
            raise ValueError("--max-batch must be at least 1")
        if not 1 <= self.verify_tokens <= self.max_seq_len:
            raise ValueError("the verify tree must hold between 1 and --max-seq-len tokens")
        if not 1 <= self.prefill_chunk <= self.max_seq_len:
            raise ValueError("--prefill-chunk must be between 1 and --max-seq-len")


def doubling(start: int, stop: int) -> list[int]:
    """start, 2*start, ... and finally stop itself: the bucket ladder."""
    values = []
    value = start
    while value < stop:
        values.append(value)
        value *= 2
    values.append(stop)
    return values


def kv_ladder(start: int, stop: int, step: int = 256) -> list[int]:
    """KV-length buckets: doubling up to `step * 2`, then every `step`, so a decode step attends over at most
    `step` padding positions at long context (a bucket change costs one copy of the used cache)."""
    values = doubling(start, min(stop, 2 * step))
    while values[-1] < stop:
        values.append(min(values[-1] + step, stop))
    return values


def exact_then_every(largest: int, exact_up_to: int, step: int) -> list[int]:
    """Every value from 1 up to `exact_up_to`, then every `step`-th, and `largest` itself (a bucket ladder)."""
    return sorted({*range(1, min(largest, exact_up_to) + 1), *range(exact_up_to + step, largest, step), largest})


def batch_sizes(max_batch: int) -> list[int]:
    """Row-count buckets for decode and verify calls: every count up to 16, then every 8. Rows a call covers but
    does not compute are not free: the matmuls run over them (docs/measurements.md)."""
    return exact_then_every(max_batch, 16, 8)


def prefill_steps(chunk: int) -> list[int]:
    """Prompt-chunk buckets: every length up to the chunk, so a chunk is never padded. Prefill is compute-bound and
    padding is paid in full (docs/measurements.md); the logits are the same bit for bit."""
    return list(range(1, chunk + 1))


def verify_steps(max_nodes: int) -> list[int]:
    """Token-tree buckets for verification: every node count up to 16, then every 4 nodes up to the largest tree.
    A verify call's cost grows with every node, so padding a tree to a larger bucket is paid (docs/measurements.md)."""
    return exact_then_every(max_nodes, 16, 4)


def plan_phases(shapes: BuildShapes) -> dict[str, PhaseSpec]:
    past = kv_ladder(shapes.min_past_len, shapes.max_seq_len)
    batches = batch_sizes(shapes.max_batch)
    return {
        "prefill": PhaseSpec("prefill", STEP_GRAPH, [1], prefill_steps(shapes.prefill_chunk), past, "last"),
        "decode": PhaseSpec("decode", STEP_GRAPH, batches, [1], past, "all"),
        "verify": PhaseSpec("verify", STEP_GRAPH, batches, verify_steps(shapes.verify_tokens), past, "all"),
        # prompt chunks with logits at every position: perplexity evaluation (`runner eval`), drafter training
        "score": PhaseSpec(
            "score", STEP_GRAPH, [1], prefill_steps(min(shapes.prefill_chunk, SCORE_CHUNK)), past, "all"
        ),
    }
