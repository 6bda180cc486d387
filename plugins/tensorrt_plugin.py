"""The blockwise matmul (plugins/blockwise_matmul.py) as a TensorRT plugin: the ONNX node the TensorRT backend's
step graph holds for every quantized linear, and its quickly deployable plugin (tensorrt.plugin, "QDP") whose
ahead-of-time implementation compiles the same Triton kernel to PTX, so that TensorRT embeds it in the engine.

TensorRT's ONNX parser hands a node it has no importer for to the plugin creator registered under the node's op
type, `plugin_namespace` and `plugin_version` attributes (the node's domain is not looked at). Importing this
module needs neither TensorRT nor a GPU; `register_plugin` does, and is called by the TensorRT build and runner.
"""

from __future__ import annotations

import torch

from plugins.blockwise_matmul import SMALL_M, TILES
from plugins.onnx_schema import register_contrib_op

NAMESPACE = "llm_engine_builder"
OP = "BlockwiseMatMul"  # symmetric blocks: x, qweight, scales
OP_WITH_MINIMUMS = "BlockwiseMatMulMinimums"  # Q4_1-style blocks: x, qweight, scales, minimums
VERSION = "1"
DOMAIN = "trt.plugins"  # any domain would do for TensorRT; onnx needs one to hold the nodes' schemas
ATTRIBUTES = {
    "in_features": int,
    "out_features": int,
    "bits": int,
    "block_size": int,
    "plugin_namespace": str,
    "plugin_version": str,
}


def onnx_translations() -> dict:
    """custom_translation_table entries for torch.onnx.export: plugins::blockwise_matmul -> one plugin node."""
    import onnxscript

    for op, minimums in ((OP, []), (OP_WITH_MINIMUMS, ["minimums:tensor(float16)"])):
        register_contrib_op(
            op,
            inputs=["x:T", "qweight:tensor(uint8)", "scales:tensor(float)", *minimums],
            outputs=["y:T"],
            types={"T": ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]},
            attributes=ATTRIBUTES,
            domain=DOMAIN,
        )
    plugins = onnxscript.values.Opset(DOMAIN, 1)

    def blockwise_matmul_to_onnx(
        x, qweight, scales, minimums, in_features: int, out_features: int, bits: int, block_size: int, tile: int
    ):
        # the tile is chosen by the plugin's build for the rows of its profile, so it is not an attribute
        attributes = dict(
            in_features=in_features,
            out_features=out_features,
            bits=bits,
            block_size=block_size,
            plugin_namespace=NAMESPACE,
            plugin_version=VERSION,
        )
        if minimums is None:
            return plugins.BlockwiseMatMul(x, qweight, scales, **attributes)
        return plugins.BlockwiseMatMulMinimums(x, qweight, scales, minimums, **attributes)

    return {torch.ops.plugins.blockwise_matmul.default: blockwise_matmul_to_onnx}


def register_plugins() -> None:
    """Register both plugins with TensorRT (needs tensorrt and triton). Their AOT implementation compiles the Triton
    kernel for the tile of the rows TensorRT calls it with: the decode tile where the row count is a constant of
    at most SMALL_M, the prompt tile otherwise. Written against tensorrt.plugin's documented API; not yet run (no
    TensorRT on the machines this was written on)."""
    import tensorrt.plugin as trtp

    def output(x, out_features):
        dims = [x.shape_expr[i] for i in range(len(x.shape_expr) - 1)] + [out_features]
        return trtp.from_shape_expr(dims, dtype=x.dtype)

    @trtp.register(f"{NAMESPACE}::{OP}")
    def describe(x: trtp.TensorDesc, qweight: trtp.TensorDesc, scales: trtp.TensorDesc, in_features: int,
                 out_features: int, bits: int, block_size: int) -> trtp.TensorDesc:  # fmt: skip
        return output(x, out_features)

    @trtp.aot_impl(f"{NAMESPACE}::{OP}")
    def compile_symmetric(x, qweight, scales, in_features, out_features, bits, block_size, outputs, tactic):
        return _compiled_kernel(trtp, x, in_features, out_features, bits, block_size, minimums=False)

    @trtp.register(f"{NAMESPACE}::{OP_WITH_MINIMUMS}")
    def describe_with_minimums(x: trtp.TensorDesc, qweight: trtp.TensorDesc, scales: trtp.TensorDesc,
                              minimums: trtp.TensorDesc, in_features: int, out_features: int, bits: int,
                              block_size: int) -> trtp.TensorDesc:  # fmt: skip
        return output(x, out_features)

    @trtp.aot_impl(f"{NAMESPACE}::{OP_WITH_MINIMUMS}")
    def compile_with_minimums(x, qweight, scales, minimums, in_features, out_features, bits, block_size, outputs,
                              tactic):  # fmt: skip
        return _compiled_kernel(trtp, x, in_features, out_features, bits, block_size, minimums=True)


def _compiled_kernel(trtp, x, in_features: int, out_features: int, bits: int, block_size: int, minimums: bool):
    """(kernel name, PTX, launch parameters, extra scalar arguments) of the Triton kernel for this node. Without
    minimums the kernel's minimum pointer is never read; TensorRT passes the output pointer after the inputs, so the
    symmetric variant's signature names one pointer less."""
    import triton

    from plugins.blockwise_matmul import _blockwise_matmul_kernel

    rows = x.shape_expr.numel() // in_features
    tile = TILES[0] if rows.is_constant and rows.constant_value <= SMALL_M else TILES[1]
    element = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[str(x.dtype).split(".")[-1].lower()]
    pointers = {"x_ptr": f"*{element}", "w_ptr": "*u8", "scale_ptr": "*fp32", "minimum_ptr": "*fp16"}
    if not minimums:
        pointers["minimum_ptr"] = "constexpr"
    source = triton.compiler.ASTSource(
        fn=_blockwise_matmul_kernel,
        signature={**pointers, "out_ptr": f"*{element}", "M": "i32", "N": "i32", "K": "i32", "n_blocks": "i32"},
        constexprs={
            **({} if minimums else {"minimum_ptr": None}),
            "BITS": bits,
            "BLOCK": block_size,
            "HAS_MINIMUMS": minimums,
            "FP32": element == "fp32",
            "BLOCK_M": tile.block_m,
            "BLOCK_N": tile.block_n,
        },
    )
    compiled = triton.compile(source, options={"num_warps": tile.num_warps})
    launch = trtp.KernelLaunchParams()
    launch.grid_x = trtp.cdiv(rows, tile.block_m)
    launch.grid_y = trtp.cdiv(out_features, tile.block_n)
    launch.block_x = compiled.metadata.num_warps * 32
    launch.shared_mem = compiled.metadata.shared
    extra = trtp.SymIntExprs(4)
    extra[0] = trtp.SymInt32(rows)
    extra[1] = trtp.SymInt32(out_features)
    extra[2] = trtp.SymInt32(in_features)
    extra[3] = trtp.SymInt32(-(-in_features // block_size))
    return compiled.metadata.name, compiled.asm["ptx"], launch, extra
