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
OP = "BlockwiseMatMul"
VERSION = "1"
DOMAIN = "trt.plugins"  # any domain would do for TensorRT; onnx needs one to hold the node's schema


def onnx_translations() -> dict:
    """custom_translation_table entries for torch.onnx.export: plugins::blockwise_matmul -> one plugin node."""
    import onnxscript

    register_contrib_op(
        OP,
        inputs=["x:T", "qweight:tensor(uint8)", "scales:tensor(float)", "offsets?:tensor(float)"],
        outputs=["y:T"],
        types={"T": ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]},
        attributes={
            "in_features": int,
            "out_features": int,
            "bits": int,
            "block_size": int,
            "plugin_namespace": str,
            "plugin_version": str,
        },
        domain=DOMAIN,
    )
    plugins = onnxscript.values.Opset(DOMAIN, 1)

    def blockwise_matmul_to_onnx(
        x, qweight, scales, offsets, in_features: int, out_features: int, bits: int, block_size: int, tile: int
    ):
        # the tile is chosen at run time by the plugin (by the rows it gets), so it is not an attribute
        return plugins.BlockwiseMatMul(
            x,
            qweight,
            scales,
            offsets,
            in_features=in_features,
            out_features=out_features,
            bits=bits,
            block_size=block_size,
            plugin_namespace=NAMESPACE,
            plugin_version=VERSION,
        )

    return {torch.ops.plugins.blockwise_matmul.default: blockwise_matmul_to_onnx}


def register_plugin() -> None:
    """Register the plugin with TensorRT (needs tensorrt and triton). Its AOT implementation compiles the Triton
    kernel for the tile of the rows TensorRT will call it with: the decode tile when the optimization profile's
    largest row count is at most SMALL_M, the prompt tile otherwise. Written against tensorrt.plugin's documented
    API; not yet run (no TensorRT on the machines this was written on)."""
    import tensorrt.plugin as trtp
    import triton

    from plugins.blockwise_matmul import _blockwise_matmul_kernel

    name = f"{NAMESPACE}::{OP}"

    @trtp.register(name)
    def describe(
        x: trtp.TensorDesc,
        qweight: trtp.TensorDesc,
        scales: trtp.TensorDesc,
        offsets: trtp.TensorDesc,
        in_features: int,
        out_features: int,
        bits: int,
        block_size: int,
    ) -> trtp.TensorDesc:
        dims = [x.shape_expr[i] for i in range(len(x.shape_expr) - 1)] + [out_features]
        return trtp.from_shape_expr(dims, dtype=x.dtype)

    @trtp.aot_impl(name)
    def compile_kernel(x, qweight, scales, offsets, in_features, out_features, bits, block_size, outputs, tactic):
        rows = x.shape_expr.numel() // in_features
        tile = TILES[0] if x.shape_expr[0].is_constant and rows.constant_value <= SMALL_M else TILES[1]
        element = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[str(x.dtype).split(".")[-1].lower()]
        source = triton.compiler.ASTSource(
            fn=_blockwise_matmul_kernel,
            signature={
                "x_ptr": f"*{element}",
                "w_ptr": "*u8",
                "scale_ptr": "*fp32",
                "offset_ptr": "*fp32",
                "out_ptr": f"*{element}",
                "M": "i32",
                "N": "i32",
                "K": "i32",
                "n_blocks": "i32",
            },
            constexprs={
                "BITS": bits,
                "BLOCK": block_size,
                "HAS_OFFSETS": True,
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
