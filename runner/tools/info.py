"""What an engine artifact holds, from its manifest: the model, how it was built (dtype, quantization,
speculation), its phase buckets, KV cache and files. `runner info ENGINE` prints it (`--json`: the manifest)."""

from __future__ import annotations

from engines.format import Artifact


def describe(artifact: Artifact) -> list[str]:
    manifest = artifact.manifest
    model, cache = manifest.model, manifest.kv_cache
    lines = [
        f"engine: {artifact.directory} (schema {manifest.schema_version}, builder {manifest.builder_version}, "
        f"backend {manifest.backend} on {manifest.device}"
        f"{', built for ' + ', '.join(f'{k} {v}' for k, v in manifest.target.items()) if manifest.target else ''})",
        f"source: {manifest.source}",
        f"model: {model.num_layers} layers, hidden {model.hidden_size}, MLP {model.intermediate_size}, "
        f"{model.num_heads} heads / {model.num_kv_heads} KV heads x {model.head_dim}, vocabulary {model.vocab_size}, "
        f"rope theta {model.rope_theta:g}{', tied embeddings' if model.tie_word_embeddings else ''}",
        f"dtype: {manifest.dtype}; quantization: {_settings(manifest.quantization.facts())}",
        f"max_seq_len: {manifest.max_seq_len}; KV cache: {cache.dtype}, updated {cache.update.replace('_', ' ')}; "
        f"tensor parallel ranks: {manifest.tensor_parallel}",
        f"speculation: {_settings(manifest.speculation.facts()) if manifest.speculation else 'none'}",
        f"sampling defaults the model recommends: "
        f"{', '.join(f'{k}={v}' for k, v in manifest.sampling_defaults.items()) or 'none'}",
        f"sampler: trees up to {manifest.sampler.max_depth} accepted drafts, top {manifest.sampler.top_logprobs} "
        "logprobs",
        f"kernels: {_kernels(manifest)}",
        *(
            f"  rank {shard.rank}: {shard.graph.file}, KV heads {_span(shard.kv_heads)}, heads {_span(shard.heads)}, "
            f"MLP {_span(shard.intermediate)}, vocabulary {_span(shard.vocab)}"
            for shard in manifest.shards
        ),
        "phases:",
        *(f"  {phase.name}: {phase.describe()}" for phase in manifest.phases.values()),
        f"files: {len(manifest.files)}, {sum(f.size for f in manifest.files.values()) / 2**20:.1f} MiB",
        *(
            f"  {name}: {entry.size / 2**20:.1f} MiB"
            for name, entry in sorted(manifest.files.items(), key=lambda f: -f[1].size)
        ),
    ]
    return lines


def _kernels(manifest) -> str:
    """Which of our kernels the step graph runs in place of onnxruntime's ops."""
    step = manifest.graphs[manifest.phases["decode"].graph]
    ours = {"DecodeAttention": "GroupQueryAttention"}
    if manifest.quantization.bits == 4:
        ours["Int4MatMul"] = "MatMulNBits"
    ours["ArgMax"] = "ArgMax"
    ours["SkipRmsNorm"] = "SkipSimplifiedLayerNormalization"
    kernels = [
        f"our {op} ({step.native_library})" if op in step.native_ops else f"onnxruntime's {theirs}"
        for op, theirs in ours.items()
    ]
    if manifest.shards:
        kernels.append(f"our AllReduce / AllGather between the {manifest.tensor_parallel} ranks")
    return "; ".join(kernels)


def _span(bounds: list[int]) -> str:
    return f"{bounds[0]}..{bounds[1] - 1}"


def _settings(settings: dict) -> str:
    """`method`, then the other settings (a section's facts(): those it sets) as key=value; long values (per-tensor
    tables) as their length."""
    rest = ", ".join(f"{key}={_short(value)}" for key, value in settings.items() if key != "method")
    return str(settings["method"]) + (f" ({rest})" if rest else "")


def _short(value) -> str:
    if isinstance(value, (dict, list)) and len(str(value)) > 60:
        return f"<{len(value)} entries>"
    return str(value)
