"""Tensor parallelism (Megatron-style), as gpt-fast's tp.py does it: each rank's model is the same model with a
share of the heads, of the MLP's inner width and of the vocabulary, and collectives where the shares meet.

- q/k/v and gate/up are column-parallel: a rank computes its heads' q, k, v (heads go by KV group, so a rank's
  query heads read only its own KV heads and its KV cache holds only those) and its share of the inner width.
- o and down are row-parallel: a rank multiplies its share of the inputs, and an AllReduce after each sums the
  ranks' partial results (two per layer).
- the LM head is vocabulary-parallel, an AllGather after it: a rank computes the logits of its share of the
  vocabulary, and every rank gets all of them (the step graph's argmax and the sampler stay as they are). The
  head is the largest matmul of a small model (the default model's is a fifth of its weights), so replicating it
  would cap the speed-up; the embedding is replicated (a step reads only its tokens' rows of it).

Shares that do not divide evenly go to the first ranks (9 query / 3 KV heads over 2 ranks: 6 + 3 / 2 + 1). The
checkpoint streams through `shard_tensors` once per rank, each tensor cut to the rank's share as it passes (GGUF
blocks cut at block boundaries, kept as blocks), so a rank's build holds its share plus one tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch

from builder.loaders.gguf_blocks import BLOCK, BlockQuantized, block_inputs
from builder.weights import fused_rows
from engines.model_config import ModelConfig
from plugins.collectives import all_gather, all_reduce


@dataclass(frozen=True)
class Share:
    """What one rank holds: [first, end) of the KV heads, query heads, MLP inner width and vocabulary."""

    rank: int
    kv_heads: tuple[int, int]
    heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]


def split(total: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """[first, end) of each of `parts` near-equal pieces of `total`, in whole `unit`s, the larger pieces first."""
    units, rest = divmod(total // unit, parts)
    bounds, start = [], 0
    for part in range(parts):
        size = (units + (part < rest)) * unit
        bounds.append((start, start + size))
        start += size
    return bounds


def plan_shares(config: ModelConfig, ranks: int) -> list[Share]:
    if ranks < 1:
        raise ValueError(f"--tp must be 1 or more, not {ranks}")
    if config.num_kv_heads < ranks:
        raise ValueError(
            f"--tp {ranks}: the model has {config.num_kv_heads} KV heads, and heads are split by KV group "
            f"(at most {config.num_kv_heads} ranks)"
        )
    group = config.num_heads // config.num_kv_heads
    # the inner width in whole GGUF blocks where it has them, so a down projection's blocks are cut whole
    unit = BLOCK if config.intermediate_size % BLOCK == 0 and config.intermediate_size >= BLOCK * ranks else 1
    kv = split(config.num_kv_heads, ranks)
    inner = split(config.intermediate_size, ranks, unit)
    vocab = split(config.vocab_size, ranks)
    return [
        Share(rank, kv[rank], (kv[rank][0] * group, kv[rank][1] * group), inner[rank], vocab[rank])
        for rank in range(ranks)
    ]


def rank_config(config: ModelConfig, share: Share) -> ModelConfig:
    """The model a rank runs: its heads and inner width; its LM head is its own tensor (rows of its vocabulary
    share, `head_rows`), even where the checkpoint ties it to the embedding, which stays whole."""
    return replace(
        config,
        num_heads=share.heads[1] - share.heads[0],
        num_kv_heads=share.kv_heads[1] - share.kv_heads[0],
        intermediate_size=share.intermediate[1] - share.intermediate[0],
        tie_word_embeddings=False,
    )


def head_rows(share: Share) -> int:
    return share.vocab[1] - share.vocab[0]


def shard_tensors(
    tensors: Iterable[tuple[str, torch.Tensor | BlockQuantized]],
    config: ModelConfig,
    share: Share,
) -> Iterator[tuple[str, torch.Tensor | BlockQuantized]]:
    """The checkpoint's tensors cut to `share`, one at a time (names as the checkpoint's, plus `lm_head.weight`
    from a tied embedding, which every rank also gets whole: a rank stores it as a single-rank engine would, in
    the head's blocks where that engine reads it from its quantized head, weights.embedding_spec). A row-parallel
    bias is added once, after the sum: rank 0 keeps it, the others zeros."""
    cuts = _projection_cuts(config, share)
    for name, tensor in tensors:
        if name == "model.embed_tokens.weight":
            yield name, tensor
            if config.tie_word_embeddings:
                yield "lm_head.weight", _rows(tensor, share.vocab, 1)
            continue
        if name == "lm_head.weight":
            yield name, _rows(tensor, share.vocab, 1)
            continue
        projection = next((key for key in cuts if f".{key}." in name), None)
        if projection is None:
            yield name, tensor  # norms (and q/k norms): every rank's whole
            continue
        axis, (first, end), unit = cuts[projection]
        if name.endswith(".bias"):
            if axis == "rows":
                yield name, tensor[first * unit : end * unit]
            else:
                yield name, tensor if share.rank == 0 else torch.zeros_like(tensor)
            continue
        cut = _rows if axis == "rows" else _columns
        yield name, cut(tensor, (first, end), unit)


def _projection_cuts(config: ModelConfig, share: Share) -> dict[str, tuple[str, tuple[int, int], int]]:
    """Each checkpoint projection -> how `share` cuts it: its "rows" (outputs) or "columns" (inputs) [first, end),
    in units of `unit` rows or columns."""
    head_dim = config.head_dim
    return {
        "self_attn.q_proj": ("rows", share.heads, head_dim),
        "self_attn.k_proj": ("rows", share.kv_heads, head_dim),
        "self_attn.v_proj": ("rows", share.kv_heads, head_dim),
        "self_attn.o_proj": ("columns", share.heads, head_dim),
        "mlp.gate_proj": ("rows", share.intermediate, 1),
        "mlp.up_proj": ("rows", share.intermediate, 1),
        "mlp.down_proj": ("columns", share.intermediate, 1),
    }


def _rows(tensor, bounds: tuple[int, int], unit: int):
    first, end = bounds[0] * unit, bounds[1] * unit
    if isinstance(tensor, BlockQuantized):
        return BlockQuantized(tensor.kind, tensor.rows[first:end], tensor.in_features)
    return tensor[first:end].clone()


def _columns(tensor, bounds: tuple[int, int], unit: int):
    first, end = bounds[0] * unit, bounds[1] * unit
    if not isinstance(tensor, BlockQuantized):
        return tensor[:, first:end].clone()
    inputs = block_inputs(tensor.kind)
    if first % inputs or end % inputs:
        raise ValueError(
            f"a {tensor.kind} weight cannot be cut at column {first}..{end}: not a block boundary (build with "
            "--requantize-gguf to quantize it again)"
        )
    blocks = tensor.rows.reshape(tensor.rows.shape[0], tensor.in_features // inputs, -1)
    kept = np.ascontiguousarray(blocks[:, first // inputs : end // inputs]).reshape(tensor.rows.shape[0], -1)
    return BlockQuantized(tensor.kind, kept, end - first)


def shard_kv_scales(scales: list[tuple[np.ndarray, np.ndarray]], share: Share) -> list[tuple[np.ndarray, np.ndarray]]:
    """A rank's share of an int8 KV cache's (K, V) scales per layer, each [1, kv_heads, 1, head_dim]: its KV heads'."""
    first, end = share.kv_heads
    return [(k[:, first:end].copy(), v[:, first:end].copy()) for k, v in scales]


def shard_quantized(
    quantized: dict[str, tuple[np.ndarray, np.ndarray]], config: ModelConfig, share: Share
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Quantized linears of the whole model (name -> blocks [N, blocks, bytes] and scales [N * blocks], the layout
    of QuantizedLinear; an embedding table's blocks [N, bytes]) cut to `share` as shard_tensors cuts the float
    weights they were made of: a fused linear's rows part by part (weights.fused_rows), o and down at block
    boundaries, the LM head's vocabulary rows; the embedding table whole."""
    cuts, fused = _projection_cuts(config, share), fused_rows(config)
    cut = {}
    for name, (qweight, scales) in quantized.items():
        scales = scales.reshape(qweight.shape[0], -1)  # (an embedding table's blocks are [rows, bytes])
        module = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
        fused_parts = [(projection, start) for projection, (whole, start, _) in fused.items() if whole == module]
        if name == "model.embed_tokens":
            parts = [(qweight, scales)]
        elif name == "lm_head":
            parts = [(qweight[slice(*share.vocab)], scales[slice(*share.vocab)])]
        elif fused_parts:
            parts = []
            for projection, start in fused_parts:
                _, (first, end), unit = cuts[projection]
                rows = slice(start + first * unit, start + end * unit)
                parts.append((qweight[rows], scales[rows]))
        elif cuts.get(module, ("",))[0] == "columns":
            _, (first, end), unit = cuts[module]
            first, end, block = first * unit, end * unit, qweight.shape[2] * 2  # GPTQ's int4: two inputs a byte
            if first % block or end % block:
                raise ValueError(
                    f"{name}'s blocks of {block} inputs cannot be cut at input {first}..{end} for rank {share.rank}: "
                    "build with a group size that divides each rank's share"
                )
            parts = [(qweight[:, first // block : end // block], scales[:, first // block : end // block])]
        else:
            raise ValueError(f"no tensor-parallel cut is known for the quantized linear {name}")
        cut[name] = (
            np.ascontiguousarray(np.concatenate([q for q, _ in parts])),
            np.ascontiguousarray(np.concatenate([s for _, s in parts])).reshape(-1),
        )
    return cut


def shard_names(names: dict[str, str], config: ModelConfig) -> dict[str, str]:
    """A checkpoint's per-name facts (GGUF block formats, weight types) for a rank's tensors: a tied embedding's
    facts are its LM head's too."""
    if config.tie_word_embeddings and "model.embed_tokens.weight" in names:
        return {**names, "lm_head.weight": names["model.embed_tokens.weight"]}
    return names


def add_collectives(model, share: Share, vocab_size: int) -> None:
    """Sum the row-parallel linears' outputs over the ranks and gather the LM head's logits (forward hooks, which
    torch.export traces: the model's own code does not change)."""

    def reduce(_module, _inputs, output):
        return all_reduce(output)

    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_hook(reduce)
        layer.mlp.down_proj.register_forward_hook(reduce)
    offset = share.vocab[0]
    model.lm_head.register_forward_hook(lambda _module, _inputs, output: all_gather(output, offset, vocab_size))
