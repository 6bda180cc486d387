"""Fill the model's parameters from a checkpoint's lazy tensor stream, one tensor at a time.

Checkpoints name q/k/v and gate/up projections apart; the model runs each group as one fused matmul, so those
tensors are copied into row ranges of the fused weight as they stream by. Where a GGUF file stores the parts of one
group in forms no single layout holds (Q4_K queries and keys beside Q6_K values), the fused linear is split into
parts of one form each (`split_linears`), each its own matmul.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import replace

import torch
from torch import nn

from builder.loaders.checkpoint import CheckpointError
from builder.loaders.gguf_blocks import BLOCK, EXACT_FORMS, BlockQuantized
from builder.model import LlamaForCausalLM
from engines.model_config import ModelConfig
from plugins.linear import StackedLinear, make_linear
from plugins.quant_linear import QuantizedEmbedding, QuantizedLinear, QuantSpec

# Checkpoint entries that carry no model weight (rotary tables some exporters save).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
EMBEDDING = "model.embed_tokens"  # the token embedding table's module
_FUSED_PATTERN = re.compile(r"(.*)\.(self_attn\.[qkv]_proj|mlp\.gate_proj|mlp\.up_proj)\.(weight|bias)")


def fused_rows(config: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """Checkpoint projection -> (fused projection, first row, end row)."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inner = config.intermediate_size
    return {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
        "self_attn.k_proj": ("self_attn.qkv_proj", q, q + kv),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, q + 2 * kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, inner),
        "mlp.up_proj": ("mlp.gate_up_proj", inner, 2 * inner),
    }


def part_name(module: str, part: int) -> str:
    """The name of part `part` of a split fused linear (plugins.linear.StackedLinear's `parts`)."""
    return f"{module}.parts.{part}"


def _part_holding(bounds: tuple[int, ...], row: int) -> int:
    """The part of a split linear whose rows [bounds[i], bounds[i + 1]) hold `row`."""
    return next(part for part in range(len(bounds) - 1) if bounds[part] <= row < bounds[part + 1])


def linear_sources(
    config: ModelConfig, quantize_lm_head: bool, splits: Mapping[str, tuple[int, ...]] | None = None
) -> dict[str, list[str]]:
    """Each quantized linear of the model -> the checkpoint weights it is made of. The parts of a split fused
    linear (`splits`, see split_linears) are linears of their own (`part_name`)."""
    splits = splits or {}
    rows = fused_rows(config)
    sources: dict[str, list[str]] = {}
    projections = (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}"
        for projection in projections:
            module, first_row = rows.get(projection, (projection, 0))[:2]
            module = f"{prefix}.{module}"
            if module in splits:
                module = part_name(module, _part_holding(splits[module], first_row))
            sources.setdefault(module, []).append(f"{prefix}.{projection}.weight")
    if quantize_lm_head:
        sources["lm_head"] = [f"{EMBEDDING}.weight" if config.tie_word_embeddings else "lm_head.weight"]
    return sources


FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
WIDE_TYPES = ("Q8_0", "Q8_1", "Q8_K", "Q6_K", "Q5_0", "Q5_1", "Q5_K")  # more than 4 bits a weight


def auto_quantization(config: ModelConfig, weight_types: Mapping[str, str]) -> str:
    """What `--quant auto` builds for a checkpoint whose layers' weights have these GGUF types (none for a Hugging
    Face checkpoint): "none" where they are float, "int4" where any is 4 bits or fewer, else "int8". With groups of
    32, Q4_0 / Q4_1 / Q4_K / Q5_0 / Q5_1 / Q5_K / Q6_K / Q8_0 blocks then go into the engine as they are
    (kept_block_specs); weights of other types are requantized, those of more than 4 bits (Q8_1, Q8_K; Q6_K where it
    cannot be kept) to int8 (wider_specs)."""
    names = [name for module, sources in linear_sources(config, False).items() for name in sources]
    types = {weight_types.get(name, "F32") for name in names}
    if types <= set(FLOAT_TYPES):
        return "none"
    return "int8" if types <= set(FLOAT_TYPES + WIDE_TYPES) else "int4"


def split_linears(
    config: ModelConfig,
    quant: QuantSpec | None,
    block_formats: Mapping[str, str],
    weight_types: Mapping[str, str],
    packed_forms: bool = False,
) -> dict[str, tuple[int, ...]]:
    """Fused linears whose checkpoint weights are stored in different forms -> the row bounds of their parts, each a
    run of consecutive weights stored alike: the same exact form's bits and block size (kept_block_specs), or
    quantized from float to the same bits (wider_specs); with `packed_forms` (our CPU kernels run the build's int8
    matmuls), also the same bits and minimums in those kernels' own form (a Q5_0 block takes 5.5 bits there, a Q8_0
    one 8.5, a Q5_1 one 6 with its minimums).
    llama.cpp's Q4_K_M gives some layers' value projection Q6_K beside Q4_K queries and keys (or, where a row is not
    a multiple of 256, Q8_0 beside Q5_0): one layout for the three would be int8 for all; split, each part keeps its
    own blocks, at the price of one more matmul node and a concatenation."""
    if quant is None:
        return {}
    packed_forms = packed_forms and quant.accuracy_level == 4  # the kernels' own forms take int8 activations
    rows = fused_rows(config)
    splits = {}
    for module, names in linear_sources(config, False).items():
        if len(names) < 2:
            continue  # not a fused linear
        forms = [
            _stored_form(quant, block_formats.get(name, ""), weight_types.get(name, ""), packed_forms) for name in names
        ]
        spans = [rows[_FUSED_PATTERN.fullmatch(name).group(2)][1:] for name in names]  # (first row, end row)
        bounds = [first for (first, _), form, before in zip(spans, forms, [None, *forms]) if form != before]
        if len(bounds) > 1:
            splits[module] = (*bounds, spans[-1][1])
    return splits


def _stored_form(
    quant: QuantSpec, block_format: str, weight_type: str, packed_forms: bool
) -> tuple[bool, int, int, tuple[int, str | None] | None]:
    """(kept as the file's blocks, bits, block size, (bits, minimums' type) in our kernels' own form where
    `packed_forms` and fewer bits) of one weight stored on its own."""
    kept = _spec_holding(quant, [block_format])
    spec = kept or _at_least_source_bits(quant, [weight_type]) or quant
    form = EXACT_FORMS.get(block_format)
    # a 5-bit form with minimums (Q5_1, Q5_K) beside one without (Q5_0) or with minimums of another type: two nodes
    packed = (form.packed_bits, form.minimum_dtype) if kept and packed_forms and form.packed_bits else None
    return kept is not None, spec.bits, spec.block_size, packed


def kept_block_specs(
    config: ModelConfig,
    quant: QuantSpec | None,
    quantize_lm_head: bool,
    block_formats: Mapping[str, str],
    head_rows_in_kernel: bool = False,
    splits: Mapping[str, tuple[int, ...]] | None = None,
) -> dict[str, QuantSpec]:
    """Quantized linears whose checkpoint blocks map exactly onto the requested quantization -> their spec.

    A linear keeps its source blocks when every weight it is made of has an exact form (gguf_blocks.EXACT_FORMS)
    of the same number of bits and block size, the build asks for groups of 32, and the source has at least the
    requested bits (a Q8_0 LM head or Q5_0 layer stays int8 in an int4 build: more bits than asked, never fewer;
    Q6_K int8 in blocks of 16, except in a tied head whose lookups read its blocks by Gathers: our QuantizedRows
    node, `head_rows_in_kernel`, reads them in the head's own form). Everything else is requantized from float.
    `splits`: fused linears split into parts (split_linears), each part a linear here."""
    if quant is None:
        return {}
    kept = {}
    for module, names in linear_sources(config, quantize_lm_head, splits).items():
        table = module == "lm_head" and config.tie_word_embeddings and not head_rows_in_kernel
        spec = _spec_holding(quant, [block_formats.get(name, "") for name in names], table)
        if spec is not None:
            kept[module] = spec
    return kept


def wider_specs(
    config: ModelConfig,
    quant: QuantSpec | None,
    quantize_lm_head: bool,
    weight_types: Mapping[str, str],
    kept: Mapping[str, QuantSpec],
    splits: Mapping[str, tuple[int, ...]] | None = None,
) -> dict[str, QuantSpec]:
    """Linears requantized from GGUF weights of more bits than `quant` has (Q8_1 or Q8_K in an int4 build, or Q6_K
    where it cannot be kept; a fused weight's parts apart where `splits` splits it) -> int8 in `quant`'s groups: a
    build that keeps the file's blocks never rounds a weight to fewer bits than the file gives it."""
    if quant is None:
        return {}
    return {
        module: wider
        for module, names in linear_sources(config, quantize_lm_head, splits).items()
        if module not in kept and (wider := _at_least_source_bits(quant, [weight_types.get(n, "") for n in names]))
    }


def _at_least_source_bits(quant: QuantSpec, kinds: list[str]) -> QuantSpec | None:
    """int8 in `quant`'s groups where `quant` has fewer bits than any of these GGUF types, else None."""
    return replace(quant, bits=8, minimums=False) if quant.bits < 8 and set(kinds) & set(WIDE_TYPES) else None


def _spec_holding(quant: QuantSpec, kinds: list[str], in_table: bool = False) -> QuantSpec | None:
    """`quant` widened to hold blocks of these GGUF types as they are, or None where it cannot: every one with an
    exact form of one bit width and block size (one a table keeps, for an embedding table or the head its lookups
    read), at least `quant`'s bits, and groups of 32 asked for."""
    forms = [EXACT_FORMS.get(kind) for kind in kinds]
    if (
        quant.block_size != BLOCK
        or None in forms
        or len({(f.bits, f.block_size) for f in forms}) != 1
        or forms[0].bits < quant.bits
        or (in_table and not all(f.in_tables for f in forms))
    ):
        return None
    minimum_dtypes = {f.minimum_dtype for f in forms} - {None}
    # float32 holds float16 minimums too (a Q4_1 slice beside a Q4_K one in a fused weight)
    minimum_dtype = "float32" if "float32" in minimum_dtypes else "float16"
    return replace(
        quant,
        bits=forms[0].bits,
        block_size=forms[0].block_size,
        minimums=bool(minimum_dtypes),
        minimum_dtype=minimum_dtype,
    )


def embedding_spec(
    quant: QuantSpec | None, tied: bool, quantize_lm_head: bool, weight_types: Mapping[str, str]
) -> QuantSpec | None:
    """The blocks the token embedding table is stored in, or None where it stays float: where the build quantizes
    nothing, or where the table is the float LM head itself (tied, `--float-lm-head`). The checkpoint's own blocks
    where they map exactly as a linear's do (kept_block_specs; a tied model's quantized head holds the same ones),
    else `quant`'s blocks rounded to nearest, int8 where the file's type has more bits (wider_specs).
    `weight_types`: the checkpoint's GGUF types by weight name (empty where no blocks are kept)."""
    if quant is None or (tied and not quantize_lm_head):
        return None
    kinds = [weight_types.get(f"{EMBEDDING}.weight", "")]
    return (
        _spec_holding(quant, kinds, in_table=True)
        or _at_least_source_bits(quant, kinds)
        or replace(quant, minimums=False)
    )


def holds_block_kind(spec: QuantSpec | None, kind: str | None) -> bool:
    """Whether `spec`'s layout holds GGUF blocks of this type as they are (None, float, holds none)."""
    form = EXACT_FORMS.get(kind or "")
    return (
        form is not None
        and spec is not None
        and spec.block_size == form.block_size
        and (form.bits, form.minimum_dtype) == (spec.bits, spec.minimum_dtype if spec.minimums else None)
    )


def store_embedding(model: LlamaForCausalLM, spec: QuantSpec) -> None:
    """Store the float embedding table of a model quantized after loading (GPTQ's) in `spec`'s blocks: the tied
    quantized head's, which it then reads, or blocks of its own."""
    if model.config.tie_word_embeddings and isinstance(model.lm_head, QuantizedLinear):
        model.embedding_from_head = True
        model.model.embed_tokens = None
        return
    table = model.model.embed_tokens.weight
    embedding = QuantizedEmbedding(table.shape[0], table.shape[1], model.dtype, spec)
    embedding.load_rows(0, table)
    model.model.embed_tokens = embedding


def _set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner), leaf, nn.Parameter(tensor, requires_grad=False))


def load_model(
    config: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor | BlockQuantized]],
    dtype: torch.dtype,
    quant: QuantSpec | None = None,
    quantize_lm_head: bool = False,
    kept: Mapping[str, QuantSpec] | None = None,
    max_positions: int | None = None,
    head_rows: int | None = None,
    embedding_quant: QuantSpec | None = None,
    wider: Mapping[str, QuantSpec] | None = None,
    splits: Mapping[str, tuple[int, ...]] | None = None,
) -> LlamaForCausalLM:
    """Build the model on the meta device and give each parameter its checkpoint tensor as it streams by.
    Quantized projections quantize each tensor (or fused slice) on arrival: no float copy of them is kept.
    Linears in `kept` (see kept_block_specs) take their checkpoint blocks as they are; `tensors` must then yield
    those weights as BlockQuantized. `max_positions`: rows of the rotary tables (every position a call may span).
    `head_rows`: the LM head's rows where it holds a share of the vocabulary (a tensor-parallel rank's).
    `embedding_quant`: the embedding table's blocks (embedding_spec; None: float); GGUF blocks that layout holds
    go in as they are. `wider`: linears quantized from float in another spec than `quant` (wider_specs).
    `splits`: fused linears run as parts over these row bounds (split_linears), named by `part_name` in `kept` and
    `wider`."""
    kept, splits = kept or {}, splits or {}
    with torch.device("meta"):
        model = LlamaForCausalLM(config, dtype, quant, quantize_lm_head, max_positions, head_rows, embedding_quant)
        for name, bounds in splits.items():
            old = model.get_submodule(name)
            parts = [
                make_linear(old.in_features, stop - start, old.bias is not None, dtype, quant)
                for start, stop in zip(bounds, bounds[1:])
            ]
            model.set_submodule(name, StackedLinear(parts))
        for name, spec in {**(wider or {}), **kept}.items():
            old = model.get_submodule(name)
            model.set_submodule(
                name, QuantizedLinear(old.in_features, old.out_features, old.bias is not None, dtype, spec)
            )
    head_from_table = config.tie_word_embeddings and isinstance(model.lm_head, QuantizedLinear)
    if head_from_table and embedding_quant is not None:
        # a tied quantized head is the embedding table too (the file's own blocks, or RTN's): no copy is made
        model.embedding_from_head = True
        model.model.embed_tokens = None
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    for module in quantized.values():
        module.to_empty(device="cpu")
    # every weight to load and its row count (a quantized linear's weight lives in its qweight/scales buffers)
    expected = {n: p.shape for n, p in model.named_parameters()}
    if model.embedding_from_head:
        expected[f"{EMBEDDING}.weight"] = (config.vocab_size, config.hidden_size)  # read into the head only
    expected.update({f"{n}.weight": (m.out_features, m.in_features) for n, m in quantized.items()})
    rows = fused_rows(config)
    filled: dict[str, int] = {}  # weight -> rows (or whole tensors) loaded
    for name, tensor in tensors:
        blocks = tensor if isinstance(tensor, BlockQuantized) else None
        if head_from_table and name == f"{EMBEDDING}.weight":
            if blocks is not None and "lm_head" in kept:
                quantized["lm_head"].load_quantized_rows(0, *blocks.to_matmul_nbits())
            else:
                quantized["lm_head"].load_rows(0, tensor if blocks is None else blocks.dequantize())
            filled["lm_head.weight"] = tensor.shape[0]
            if model.embedding_from_head:
                filled[name] = tensor.shape[0]
                continue
        if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        target, start, stop = name, 0, None
        fused = _FUSED_PATTERN.fullmatch(name)
        if fused is not None:
            prefix, projection, kind = fused.groups()
            fused_name, start, stop = rows[projection]
            module = f"{prefix}.{fused_name}"
            if module in splits:
                bounds = splits[module]
                part = _part_holding(bounds, start)
                module, start, stop = part_name(module, part), start - bounds[part], stop - bounds[part]
            target = f"{module}.{kind}"
        if target not in expected:
            raise CheckpointError(f"unexpected tensor {name!r} in checkpoint (not a Llama weight)")
        want = expected[target]
        want = want if stop is None else (stop - start, *want[1:])
        if tuple(tensor.shape) != tuple(want):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, config implies {tuple(want)}")
        owner_name, _, leaf = target.rpartition(".")
        takes_blocks = (
            blocks is not None
            and leaf == "weight"
            and (owner_name in kept or owner_name == EMBEDDING and holds_block_kind(embedding_quant, blocks.kind))
        )
        if blocks is not None and not takes_blocks:
            tensor = blocks.dequantize()
        if takes_blocks:
            quantized[owner_name].load_quantized_rows(start, *blocks.to_matmul_nbits())
        elif owner_name in quantized and leaf == "weight":
            quantized[owner_name].load_rows(start, tensor)
        elif stop is None:
            _set_parameter(model, target, tensor.to(dtype))
        else:
            param = model.get_parameter(target)
            if param.is_meta:
                _set_parameter(model, target, torch.empty(expected[target], dtype=dtype))
                param = model.get_parameter(target)
            param.data[start:stop] = tensor.to(dtype)
        filled[target] = filled.get(target, 0) + (tensor.shape[0] if len(tensor.shape) else 1)
    missing = sorted(n for n, shape in expected.items() if filled.get(n, 0) != (shape[0] if len(shape) else 1))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(f"checkpoint is missing weights for {', '.join(missing[:3])}{more}")
    return model.eval()
