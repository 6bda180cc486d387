"""Int4 weight-only matmuls: our own onnxruntime CPU kernel (int4_matmul.c), a custom op `Int4MatMul` that takes
com.microsoft::MatMulNBits's place in the step graph for int4 weights with int8 activations (accuracy_level 4), its
weights, scales and minimums reordered into the kernel's column tiles (`tile_weights`, `tile_per_block`: 16 columns
side by side per 32 values of K, so one vector load feeds 16 columns), its scales stored as float16 (`half_scales`),
and the MLP's activation folded into the gate / up projection's node (`fuse_swiglu`).

Why: its result for a row does not depend on the other rows of the call (batch invariance), where onnxruntime's
kernel rounds one row differently from several, so an engine had to pad one-row decode calls to two rows to keep a
request's greedy tokens the same alone and in a batch (`Executor.pad_single_rows_if_they_round_differently`). And a
call's rows share the weight stream: the column tiles are unpacked once for 4 rows at a time (8 on the VNNI tiles),
and the per-column work is one fma per 32 values (docs/quantization.md has the times per number of rows). Results
match onnxruntime's int8 path to float rounding (the same per-32 activation quantization).

Covered: bits 4 (`Int4MatMul`) and 8 (`Int8MatMul`, which holds GGUF Q8_0 blocks; Q5_0's, whose values fit 5 bits,
as `Int5MatMul`: `five_bit_nodes`), accuracy_level 4, blocks of a power of 2 from 32 that divides K; and int8 blocks
of 16 that hold GGUF Q6_K's 6-bit values and factored scales (`six_bit_nodes`), as `Int6MatMul` in 6.5625 bits a
weight; other nodes (fp32 compute, other blocks of 16) keep MatMulNBits. Blocks of 32 with minimums (GGUF Q4_1 /
Q5_1: w = scale * q + minimum, float16 minimums as the file holds them; Q4_K / Q5_K: float32 scales and minimums,
the products llama.cpp computes) are exported as Int4MatMul / Int8MatMul nodes with a fourth input already
(plugins/quant_linear.py), which MatMulNBits cannot express exactly; the int8 ones' values fit 5 bits and they run
as Int5MatMul; Q4_K's and Q5_K's scales and minimums are stored as the file factors them (`factored_scales`: uint8
multipliers per 32 inputs, float16 factors per 256, a fifth input), and the kernel forms the same products. The
kernel needs AVX2, FMA and F16C at run time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from plugins.native_ops import DOMAIN, rewrite_initializers, rewrite_nodes


def unavailable_reason(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """Why an engine built on this machine should not run the kernel (it needs AVX2, FMA and F16C), or None."""
    flags = (
        next(
            (line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), []
        )
        if cpuinfo.is_file()
        else []
    )
    missing = [flag for flag in ("avx2", "fma", "f16c") if flag not in flags]
    return f"this CPU lacks {' and '.join(f.upper() for f in missing)}, which the kernel needs" if missing else None


OPS = {4: "Int4MatMul", 8: "Int8MatMul"}  # bits -> our op
INT6_OP = "Int6MatMul"  # Q6_K's 6-bit blocks, which no MatMulNBits node holds as such (`six_bit_nodes`)
INT5_OP = "Int5MatMul"  # 5-bit blocks (Q5_0, Q5_1, Q5_K), held by int8 nodes (`five_bit_nodes`)
KERNEL_OPS = (*OPS.values(), INT6_OP, INT5_OP)
OP_BITS = {"Int4MatMul": 4, INT5_OP: 5, INT6_OP: 6, "Int8MatMul": 8}  # bits a weight's value takes in each op
ROWS_OP = "QuantizedRows"  # the embedding lookup from a tied head's blocks (plugins/quant_linear.py's `rows`)


def kernel_for(attributes: dict, input_count: int) -> str | None:
    """Our op that computes what a MatMulNBits node with these attributes and inputs computes, or None."""
    block, k = attributes.get("block_size", 0), attributes.get("K", 0)
    covered = (
        attributes.get("accuracy_level") == 4
        and input_count == 3
        and block >= 32
        and block & (block - 1) == 0
        and k % block == 0
    )
    return OPS.get(attributes.get("bits")) if covered else None


COLUMN_TILE = 16  # columns per tile of the kernels' weight layout (int4_matmul.c), their nodes' column_tile


def use_in_graph(graph_file: Path) -> dict[str, int]:
    """Replace every MatMulNBits node of `graph_file` our kernels cover by Int4MatMul / Int8MatMul (Int6MatMul for
    Q6_K's blocks, `six_bit_nodes`: their values in 6 bits, their scales as int8 multipliers of float16 factors;
    Int5MatMul for int8 blocks whose values fit 5 bits, Q5_0's, and Int8MatMul nodes with minimums, Q5_1's and
    Q5_K's, `five_bit_nodes`),
    store their weights, scales and minimums in the kernels' column tiles (`tile_weights`, `tile_per_block`; a
    tied head's QuantizedRows node, the embedding lookup, then reads them as its head does:
    `_rows_read_their_matmuls`), the scales of int4 nodes as float16 (`half_scales`; int8 nodes' only where float16
    holds them exactly, as GGUF Q8_0's; those of nodes with float32 minimums, GGUF Q4_K's and Q5_K's, stay float32
    as the kernel wants them, or factored where they factor: `factored_scales`), and fold the MLP activation into the
    gate / up node (`fuse_swiglu`); returns how many nodes run each op."""
    from onnx import helper

    counts = dict.fromkeys(KERNEL_OPS, 0)
    tiled: dict[str, tuple] = {}  # initializer -> (role, N, bits) of the node that reads it
    minimums_of: dict[str, str] = {}  # scales -> the minimums beside them
    six_bit = six_bit_nodes(graph_file)  # scales -> their int8 multipliers and float16 factors
    five_bit = five_bit_nodes(graph_file)  # weights
    unsigned: set[str] = set()  # weights of nodes with minimums: their 5-bit values stored as they are, no offset
    factors: dict[str, np.ndarray] = {}  # initializers added: factors in column tiles

    def replace(node):
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        inputs = list(node.input)
        if node.op_type in counts and node.domain == DOMAIN:  # exported as ours (blocks with minimums)
            op = INT5_OP if inputs[1] in five_bit else node.op_type
            if op == OPS[8]:
                raise ValueError(
                    f"{op} node {node.name!r} has minimums, which only Int5MatMul takes, and values beyond 5 bits "
                    "(or weights another node reads too)"
                )
            if op == INT5_OP:
                unsigned.add(inputs[1])
        elif node.op_type == "MatMulNBits" and node.domain == "com.microsoft" and inputs[2] in six_bit:
            op, inputs = INT6_OP, [*inputs, _factors_of(inputs[2])]
            factors[inputs[3]] = tile_per_block(six_bit[inputs[2]][1], attributes["N"])
        elif node.op_type == "MatMulNBits" and node.domain == "com.microsoft" and inputs[1] in five_bit:
            op = INT5_OP
        elif node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
            op = kernel_for(attributes, len(node.input))
        else:
            return None
        if op is None:
            return None
        bits = OP_BITS[op]
        for role, name in zip(("weights", "scales", "minimums"), node.input[1:]):
            tiled[name] = (role, attributes["N"], bits)
        if len(node.input) == 4:
            minimums_of[node.input[2]] = node.input[3]
        counts[op] += 1
        kept = {key: attributes[key] for key in ("K", "N", "block_size", "swiglu") if key in attributes}
        return helper.make_node(
            op, inputs, list(node.output), name=node.name, domain=DOMAIN, **kept, column_tile=COLUMN_TILE
        )

    rewrite_nodes(graph_file, replace)
    _refuse_other_readers(graph_file, set(tiled))
    float32 = _float32_initializers(graph_file)
    float_minimums = {scales for scales, minimums in minimums_of.items() if minimums in float32}
    multipliers, factored = _factored_nodes(graph_file, {s: minimums_of[s] for s in float_minimums}, tiled)
    factors.update(factored)
    multipliers.update({scales: found[0] for scales, found in six_bit.items()})

    def convert(name: str, role: str, n: int, bits: int):
        if role == "weights" and bits == 6:
            return lambda packed: tile_weights(six_bit_bytes(packed.reshape(n, -1) - np.uint8(SIX_BIT_OFFSET)), 6)
        if role == "weights" and bits == 5:
            offset = np.uint8(0 if name in unsigned else FIVE_BIT_OFFSET)
            return lambda packed: tile_weights(five_bit_bytes(packed.reshape(n, -1) - offset), 5)
        if role == "weights":
            return lambda packed: tile_weights(packed, bits)
        if name in multipliers:
            return lambda _: tile_per_block(multipliers[name], n)
        if role == "scales" and name not in float_minimums:
            narrow = half_scales if bits == 4 else exact_half_scales
            return lambda scales: tile_per_block(_or_as_is(narrow(scales), scales), n)
        return lambda values: tile_per_block(values, n)

    rewrite_initializers(graph_file, {name: convert(name, *spec) for name, spec in tiled.items()}, factors)

    def reads_factors(node):
        if (
            node.op_type not in ("Int4MatMul", INT5_OP)
            or len(node.input) != 4
            or _factors_of(node.input[2]) not in factors
        ):
            return None
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        inputs = [*node.input, _factors_of(node.input[2])]
        return helper.make_node(node.op_type, inputs, list(node.output), name=node.name, domain=DOMAIN, **attributes)

    rewrite_nodes(graph_file, reads_factors)
    counts[ROWS_OP] = _rows_read_their_matmuls(graph_file)
    fuse_swiglu(graph_file)
    return counts


def _rows_read_their_matmuls(graph_file: Path) -> int:
    """Give each QuantizedRows node the inputs of the matmul node of ours that reads the same weights, in the form
    they are stored now (tiles, float16 or factored scales, factors), and that node's format; returns how many."""
    import onnx
    from onnx import helper

    model = onnx.load(str(graph_file), load_external_data=False)
    matmuls = {node.input[1]: node for node in model.graph.node if node.domain == DOMAIN and node.op_type in KERNEL_OPS}

    def replace(node):
        if node.op_type != ROWS_OP or node.domain != DOMAIN:
            return None
        matmul = matmuls.get(node.input[1])
        if matmul is None:
            raise ValueError(f"{ROWS_OP} node {node.name!r} reads {node.input[1]!r}, which none of our matmuls reads")
        attributes = {a.name: helper.get_attribute_value(a) for a in matmul.attribute}
        return helper.make_node(
            ROWS_OP,
            [node.input[0], *matmul.input[1:]],
            list(node.output),
            name=node.name,
            domain=DOMAIN,
            K=attributes["K"],
            N=attributes["N"],
            bits=OP_BITS[matmul.op_type],
            block_size=attributes["block_size"],
            column_tile=COLUMN_TILE,
        )

    return rewrite_nodes(graph_file, replace)


CHUNKS_PER_SUPER_BLOCK = 8  # blocks of 32 whose scales share a factor: a K-quant super-block of 256 (int4_matmul.c)


def _factors_of(scales: str) -> str:
    return f"{scales}/factors"


def _factored_nodes(
    graph_file: Path, minimums_of: dict[str, str], tiled: dict[str, tuple]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The nodes whose float32 scales and minimums (`minimums_of`: scales -> minimums) both factor
    (`factored_scales`) and that nothing but the node reads: (scales and minimums -> their uint8 multipliers
    [N, K / 32], `_factors_of(scales)` -> the float16 factors in column tiles, per 256 inputs the scales' then the
    minimums')."""
    from onnx import numpy_helper

    _, readers, tensors = _readers_and_initializers(graph_file)
    multipliers, factors = {}, {}
    for scales, minimums in minimums_of.items():
        if readers.get(scales) != 1 or readers.get(minimums) != 1:
            continue  # read by another node too, which wants the floats
        n = tiled[scales][1]
        both = [
            numpy_helper.to_array(tensors[name], str(graph_file.parent)).reshape(n, -1) for name in (scales, minimums)
        ]
        if both[0].shape[1] % CHUNKS_PER_SUPER_BLOCK or None in (found := [factored_scales(v) for v in both]):
            continue
        (multipliers[scales], scale_factors), (multipliers[minimums], minimum_factors) = found
        factors[_factors_of(scales)] = tile_per_block(np.stack((scale_factors, minimum_factors), -1), n)
    return multipliers, factors


def _readers_and_initializers(graph_file: Path) -> tuple:
    """The graph (no weights loaded), how many node inputs other than QuantizedRows nodes' read each name, and its
    initializers by name."""
    import onnx

    model = onnx.load(str(graph_file), load_external_data=False)
    readers: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type == ROWS_OP and node.domain == DOMAIN:
            continue  # reads a matmul node's inputs in whatever form they are stored (`_rows_read_their_matmuls`)
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    return model, readers, {t.name: t for t in model.graph.initializer}


SIX_BIT_OFFSET = 96  # an int8 block's stored q + 128 less this: Q6_K's unsigned 6-bit value (q + 32)
SIX_BIT_BLOCK = 16  # inputs per Q6_K multiplier
SIX_BIT_PER_SUPER_BLOCK = 16  # multipliers per float16 factor (256 inputs)


def six_bit_nodes(graph_file: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The int8 MatMulNBits nodes (blocks of 16, int8 activations) that hold GGUF Q6_K blocks exactly, which the
    build keeps so (builder/loaders/gguf_blocks.py) for every backend to run: each value within 6 bits (q - 32 with
    q of 0..63), the scales d x sc of a float16 d per 256 inputs and int8 multipliers, nothing but the node reading
    them. Their scales -> (int8 multipliers [N, K / 16], float16 factors [N, K / 256]); Int6MatMul takes them so,
    6.5625 bits a weight, where MatMulNBits reads 10."""
    from onnx import helper, numpy_helper

    model, readers, tensors = _readers_and_initializers(graph_file)
    found = {}
    for node in model.graph.node:
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (
            node.op_type != "MatMulNBits"
            or len(node.input) != 3
            or (attributes.get("bits"), attributes.get("block_size"), attributes.get("accuracy_level")) != (8, 16, 4)
            or attributes["K"] % (SIX_BIT_BLOCK * SIX_BIT_PER_SUPER_BLOCK)
            or any(readers.get(name) != 1 or name not in tensors for name in node.input[1:])
        ):
            continue
        weights, scales = (numpy_helper.to_array(tensors[name], str(graph_file.parent)) for name in node.input[1:])
        if (factored := six_bit_form(weights, scales.reshape(attributes["N"], -1))) is not None:
            found[node.input[2]] = factored
    return found


FIVE_BIT_OFFSET = 112  # an int8 block's stored q + 128 less this: Q5_0's unsigned 5-bit value (q + 16)


def five_bit_nodes(graph_file: Path) -> set[str]:
    """The weights of the int8 nodes our kernels run whose values all fit 5 bits, nothing but the node reading them:
    MatMulNBits nodes with q - 16 for q of 0..31 (GGUF Q5_0's, which the build keeps as int8 blocks for every
    backend to run), and our Int8MatMul nodes with minimums with q of 0..31 (Q5_1's and Q5_K's, w = scale x q +
    minimum). Int5MatMul takes them in 5 bits, 5.5 bits a weight with Q5_0's float16 scales as the file, where
    Int8MatMul reads 8.5."""
    from onnx import helper, numpy_helper

    model, readers, tensors = _readers_and_initializers(graph_file)
    found = set()
    for node in model.graph.node:
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        weights = node.input[1] if len(node.input) > 1 else ""
        ours_with_minimums = node.op_type == OPS[8] and node.domain == DOMAIN and len(node.input) == 4
        covered = node.domain == "com.microsoft" and kernel_for(attributes, len(node.input)) == OPS[8]
        if (
            not (ours_with_minimums or (node.op_type == "MatMulNBits" and covered))
            or readers.get(weights) != 1
            or weights not in tensors
        ):
            continue
        values = numpy_helper.to_array(tensors[weights], str(graph_file.parent))
        lowest = 0 if ours_with_minimums else FIVE_BIT_OFFSET
        if values.min() >= lowest and values.max() <= lowest + 31:
            found.add(weights)
    return found


def five_bit_bytes(values: np.ndarray) -> np.ndarray:
    """Unsigned 5-bit values [N, K] -> Int5MatMul's 20 bytes per column and 32 inputs [N, K / 32, 20], which
    `tile_weights(..., 5)` puts in column tiles: the low nibbles as int4's 16 bytes (value 2i in byte i's low nibble,
    2i + 1 in its high one), then 4 bytes whose byte b holds the high bit of value 8s + 2b + odd in bit 2s + odd."""
    n = values.shape[0]
    chunks = values.reshape(n, -1, 32).astype(np.uint8)
    lows = (chunks[..., 0::2] & 15) | (chunks[..., 1::2] & 15) << 4
    highs = (chunks >> 4).reshape(n, -1, 4, 4, 2)  # [.., s, b, odd]
    shifts = (2 * np.arange(4).reshape(4, 1, 1) + np.arange(2)).astype(np.uint8)  # bit 2s + odd
    packed = (highs << shifts).sum(axis=(2, 4), dtype=np.uint8)  # [.., b]
    return np.concatenate((lows, packed), axis=-1)


def six_bit_form(weights: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Int8 blocks of 16 (stored q + 128, scales [N, K / 16]) as Int6MatMul takes them, (int8 multipliers, float16
    factors), or None where they are not Q6_K's: a value beyond 6 bits, or scales that do not factor."""
    if weights.min() < SIX_BIT_OFFSET or weights.max() > SIX_BIT_OFFSET + 63:
        return None
    return factored_scales(scales, SIX_BIT_PER_SUPER_BLOCK, signed=True)


def takes_minimums(spec, weights: np.ndarray) -> bool:
    """Whether our kernels take a quantized linear of this spec with block minimums in its node (plugins/
    quant_linear.py's `native_minimums`): int8 activations, blocks of 32, int4 values (Int4MatMul) or int8 ones that
    all fit 5 bits (Int5MatMul; GGUF Q5_1's and Q5_K's). Others export as MatMulNBits beside an offset matmul."""
    if (spec.block_size, spec.accuracy_level) != (32, 4):
        return False
    return spec.bits == 4 or (spec.bits == 8 and int(weights.max(initial=0)) <= 31)


def covers(spec, in_features: int, weights: np.ndarray, scales: np.ndarray) -> bool:
    """Whether the build's kernels run a quantized linear of this spec (plugins/quant_linear.py's QuantSpec) and
    these blocks (MatMulNBits's layout): the matmul node it exports becomes one of ours."""
    attributes = {
        "bits": spec.bits,
        "block_size": spec.block_size,
        "K": in_features,
        "accuracy_level": spec.accuracy_level,
    }
    if spec.minimums:
        return takes_minimums(spec, weights) and kernel_for(attributes, 3) is not None
    if kernel_for(attributes, 3) is not None:
        return True
    six_bit = (spec.bits, spec.block_size, spec.accuracy_level) == (8, SIX_BIT_BLOCK, 4) and not spec.minimums
    return six_bit and not in_features % 256 and six_bit_form(weights, scales.reshape(len(weights), -1)) is not None


def six_bit_bytes(values: np.ndarray) -> np.ndarray:
    """Unsigned 6-bit values [N, K] -> Int6MatMul's 24 bytes per column and 32 inputs [N, K / 32, 24], which
    `tile_weights(..., 6)` puts in column tiles: the low nibbles as int4's 16 bytes (value 2i in byte i's low
    nibble, 2i + 1 in its high one), then per 16 inputs 16h.. 4 bytes whose byte b holds the high two bits of values
    16h + 2b, 16h + 2b + 1, 16h + 8 + 2b and 16h + 8 + 2b + 1, from its lowest bits up."""
    n = values.shape[0]
    chunks = values.reshape(n, -1, 32)
    lows = (chunks[..., 0::2] & 15) | ((chunks[..., 1::2] & 15) << 4)
    highs = (chunks >> 4).reshape(n, -1, 2, 2, 4, 2).astype(np.uint32)  # [.., half, vector, byte, even / odd]
    shifts = 2 * (2 * np.arange(2).reshape(2, 1, 1) + np.arange(2))  # by vector and even / odd
    packed = (highs << shifts).sum(axis=(-3, -1)).astype(np.uint8)  # [.., half, byte]
    return np.concatenate((lows.astype(np.uint8), packed.reshape(n, -1, 8)), axis=-1)


def factored_scales(
    values: np.ndarray, per_super_block: int = CHUNKS_PER_SUPER_BLOCK, signed: bool = False
) -> tuple[np.ndarray, np.ndarray] | None:
    """Per-block float32 values [N, K / block] as a float16 factor per `per_super_block` of them (256 inputs) times
    uint8 multipliers (int8 where `signed`), exactly, or None where they do not factor so: GGUF Q4_K's scales d x sc
    and minimums -(dmin x m) of 32 inputs are such products (d, dmin float16, sc and m 6-bit), as Q6_K's scales
    d x sc of 16 are (sc int8). The kernels read them factored (Q4_K: 4.625 bits a weight instead of 6), forming the
    same products. Which factoring is found does not matter: every one gives the same products.

    How: the value of largest magnitude of a super-block is factor x multiplier for some multiplier in range
    (llama.cpp's largest is mostly 63 for Q4_K, -128 for Q6_K: tried first); each candidate factor is kept where it
    is a float16 and multiplies integers in range to all the super-block's values exactly."""
    n = values.shape[0]
    groups = values.astype(np.float32).reshape(-1, per_super_block)
    if signed:
        lowest, highest, candidates = -128, 127, (-128, *range(127, 0, -1), *range(-127, 0))
    else:
        lowest, highest, candidates = 0, 255, (*range(63, 0, -1), *range(64, 256))
    largest = groups[np.arange(len(groups)), np.abs(groups).argmax(-1)]
    factors = np.zeros(len(groups), np.float32)
    multipliers = np.zeros(groups.shape, np.int8 if signed else np.uint8)
    unsolved = np.flatnonzero(largest != 0)  # all zero: factor 0
    with np.errstate(all="ignore"):
        for multiplier in candidates:
            if not len(unsolved):
                break
            factor = largest[unsolved] / np.float32(multiplier)
            ratios = np.rint(groups[unsolved] / factor[:, None])
            exact = (factor.astype(np.float16).astype(np.float32) == factor) & (
                (ratios >= lowest) & (ratios <= highest) & (factor[:, None] * ratios == groups[unsolved])
            ).all(-1)
            factors[unsolved[exact]] = factor[exact]
            multipliers[unsolved[exact]] = ratios[exact].astype(multipliers.dtype)
            unsolved = unsolved[~exact]
    if len(unsolved):
        return None
    return multipliers.reshape(n, -1), factors.astype(np.float16).reshape(n, -1)


def _float32_initializers(graph_file: Path) -> set[str]:
    import onnx

    model = onnx.load(str(graph_file), load_external_data=False)
    return {t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT}


def tile_weights(packed: np.ndarray, bits: int) -> np.ndarray:
    """MatMulNBits's weights [N, K / block, block * bits / 8] in the kernels' column tiles: per tile of COLUMN_TILE
    columns (N padded with zero columns to whole tiles), per 32 values of K, `bits` vectors whose lane j holds 4
    bytes of column j; returned as [N' * K / 32 * bits, 4], one row a lane."""
    n = packed.shape[0]
    words = _pad_columns(packed.reshape(n, -1, bits, 4))  # [N', chunks, vectors, 4]
    tiles = words.reshape(-1, COLUMN_TILE, *words.shape[1:])  # [tiles, columns, chunks, vectors, 4]
    return np.ascontiguousarray(tiles.transpose(0, 2, 3, 1, 4)).reshape(-1, 4)


def tile_per_block(values: np.ndarray, n: int) -> np.ndarray:
    """Scales or minimums, one per column and block ([N * blocks] or [N, blocks]), in the same column tiles: per
    tile, per block, the tile's COLUMN_TILE columns; [N' * blocks]."""
    per_column = _pad_columns(values.reshape(n, -1))
    return np.ascontiguousarray(per_column.reshape(-1, COLUMN_TILE, per_column.shape[1]).transpose(0, 2, 1)).reshape(-1)


def _pad_columns(per_column: np.ndarray) -> np.ndarray:
    missing = -len(per_column) % COLUMN_TILE
    return np.concatenate([per_column, np.zeros((missing, *per_column.shape[1:]), per_column.dtype)])


def _or_as_is(narrowed: np.ndarray | None, values: np.ndarray) -> np.ndarray:
    return values if narrowed is None else narrowed


def _refuse_other_readers(graph_file: Path, tiled: set[str]) -> None:
    """An error where a node other than ours reads an initializer about to be tiled (it would read the tiles as
    the layout it was exported for). A tied head's embedding lookup is our QuantizedRows node wherever our kernels
    run the head (builder/build.py's `_export_for_our_kernels`)."""
    import onnx

    for node in onnx.load(str(graph_file), load_external_data=False).graph.node:
        if node.domain != DOMAIN and (read := set(node.input) & tiled):
            raise ValueError(f"{node.op_type} node {node.name!r} reads {min(read)!r}, which the quantized matmuls tile")


def fuse_swiglu(graph_file: Path) -> int:
    """Fold each MLP activation after an Int4MatMul into it (its `swiglu` attribute): the product's halves split,
    silu(gate) * up as the exporter writes it (Split -> Sigmoid, Mul(gate, sigmoid), Mul(silu, up)), nothing else
    reading what is in between. Three fewer kernels a layer. Returns how many it folded."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(graph_file), load_external_data=False)
    graph = model.graph
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {value.name for value in graph.output}
    constants = {t.name: t for t in graph.initializer}

    def only_reader(name: str, op: str):
        found = readers.get(name, [])
        return found[0] if len(found) == 1 and found[0].op_type == op and name not in outputs else None

    removed, fused = set(), {}
    for node in graph.node:
        if node.op_type not in KERNEL_OPS or node.domain != DOMAIN:
            continue
        half = next(a.i for a in node.attribute if a.name == "N") // 2
        split = only_reader(node.output[0], "Split")
        # along the last axis of the [batch, tokens, N] product (Split's axis defaults to 0)
        if (
            split is None
            or len(split.output) != 2
            or next((a.i for a in split.attribute if a.name == "axis"), 0) not in (-1, 2)
        ):
            continue
        if len(split.input) > 1 and (
            split.input[1] not in constants or numpy_helper.to_array(constants[split.input[1]]).tolist() != [half, half]
        ):
            continue
        gate, up = split.output
        gate_readers, up_reader = readers.get(gate, []), only_reader(up, "Mul")
        sigmoid = next((r for r in gate_readers if r.op_type == "Sigmoid"), None)
        silu = next((r for r in gate_readers if r.op_type == "Mul"), None)
        if (
            len(gate_readers) != 2
            or sigmoid is None
            or silu is None
            or gate in outputs
            or up_reader is None
            or set(silu.input) != {gate, sigmoid.output[0]}
            or only_reader(sigmoid.output[0], "Mul") is not silu
            or only_reader(silu.output[0], "Mul") is not up_reader
            or set(up_reader.input) != {silu.output[0], up}
        ):
            continue
        fused[id(node)] = helper.make_node(
            node.op_type,
            list(node.input),
            list(up_reader.output),
            name=node.name,
            domain=DOMAIN,
            **{a.name: helper.get_attribute_value(a) for a in node.attribute},
            swiglu=1,
        )
        removed.update(id(n) for n in (split, sigmoid, silu, up_reader))
    if fused:
        nodes = [fused.get(id(n), n) for n in graph.node if id(n) not in removed]
        del graph.node[:]
        graph.node.extend(nodes)
        onnx.save(model, str(graph_file))
    return len(fused)


def half_scales(scales: np.ndarray) -> np.ndarray | None:
    """The scales as float16, which the kernel reads as well as float: a weight streams 4.5 bits from memory instead
    of 5, and decode is bound by that stream. Their rounding (relative 2^-11) is ~1/100 of the int4 rounding of the
    weights they scale (a step of 1/7 of a block's largest magnitude); None where one would overflow float16."""
    with np.errstate(over="ignore"):  # an overflow is the answer None, not a warning in the build's output
        half = scales.astype(np.float16)
    return half if np.isfinite(half).all() else None


def exact_half_scales(scales: np.ndarray) -> np.ndarray | None:
    """The scales as float16 where that loses nothing (GGUF Q8_0's are float16 in the file), else None: int8
    weights round 16x finer than int4, so a float16 scale's rounding would no longer be small against theirs."""
    half = scales.astype(np.float16)
    return half if np.array_equal(half.astype(scales.dtype), scales) else None
