"""The quantized linear plugin: packing bit-exact against an independent numpy reference, the reference op, and
its ONNX lowering to com.microsoft::MatMulNBits run by onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from plugins.native_ops import DOMAIN
from plugins.quant_linear import (
    QuantizedEmbedding,
    QuantizedLinear,
    QuantSpec,
    dequantize_blockwise,
    onnx_translations,
    quantize_blockwise,
)


def numpy_reference_quantize(weight: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Written from the MatMulNBits spec, independently of the plugin: q = clip(round(w / s), -2^(bits-1),
    2^(bits-1) - 1) + 2^(bits-1); int4: s = (the block's value of largest |w|) / -8 (llama.cpp's Q4_0 rule);
    int8: s = max|w| / 127."""
    n, k = weight.shape
    blocks = -(-k // block)
    padded = np.zeros((n, blocks * block), np.float32)
    padded[:, :k] = weight
    grouped = padded.reshape(n, blocks, block)
    qmax = 2 ** (bits - 1) - 1
    if bits == 4:
        scales = np.take_along_axis(grouped, np.abs(grouped).argmax(-1)[..., None], -1)[..., 0] / -8
    else:
        scales = np.abs(grouped).max(-1) / qmax
    scales[scales == 0] = 1.0
    q = (np.clip(np.round(grouped / scales[..., None]), -(qmax + 1), qmax) + qmax + 1).astype(np.uint8)
    if bits == 4:
        packed = np.zeros((n, blocks, block // 2), np.uint8)
        for i in range(block // 2):
            packed[..., i] = q[..., 2 * i] | (q[..., 2 * i + 1] << 4)  # low nibble first
        q = packed
    return q, scales.reshape(-1)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [16, 32, 64, 128])
@pytest.mark.parametrize("shape", [(48, 64), (7, 200), (1, 576)])  # 200 and 576 are not multiples of every block
def test_packing_is_bit_exact_and_round_trips(bits, block, shape):
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    qweight, scales = quantize_blockwise(weight, bits, block)
    expected_q, expected_scales = numpy_reference_quantize(weight.numpy(), bits, block)
    np.testing.assert_array_equal(qweight.numpy(), expected_q)
    np.testing.assert_array_equal(scales.numpy(), expected_scales.astype(np.float32))
    restored = dequantize_blockwise(qweight, scales, shape[1], bits)
    step = scales.view(shape[0], -1).repeat_interleave(block, dim=1)[:, : shape[1]]
    error = (restored - weight).abs()
    # round to nearest: at most half a step, except values beyond the highest code (opposite in sign to the block's
    # extreme, more than 2^(bits-1) - 0.5 steps away from 0), which clamp to it: less than a step
    clamped = weight / step > 2 ** (bits - 1) - 1 + 0.5
    assert torch.all(error[~clamped] <= step.abs()[~clamped] / 2 + 1e-6)
    assert torch.all(error[clamped] < step.abs()[clamped])
    assert torch.all((weight / step).abs() <= 2 ** (bits - 1) + 1e-4)


def export_one_linear(tmp_path, linear: QuantizedLinear, batch_shape=(2, 3)):
    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = linear

        def forward(self, x):
            return self.linear(x)

    x = torch.randn(*batch_shape, linear.in_features)
    path = tmp_path / "linear.onnx"
    torch.onnx.export(
        Wrapper().eval(),
        (x,),
        str(path),
        dynamo=True,
        custom_translation_table=onnx_translations(),
        dynamic_shapes=({0: torch.export.Dim("b"), 1: torch.export.Dim("t")},),
    )
    return path, x


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("accuracy_level, tolerance", [(0, 1e-5), (4, 3e-2)])
def test_onnx_lowering_is_one_fused_matmulnbits_matching_the_reference(tmp_path, bits, accuracy_level, tolerance):
    import onnx
    import onnxruntime as ort

    torch.manual_seed(1)
    linear = QuantizedLinear(200, 48, bias=True, dtype=torch.float32, spec=QuantSpec(bits, 32, accuracy_level))
    linear.load_rows(0, torch.randn(30, 200))
    linear.load_rows(30, torch.randn(18, 200))  # fused weights arrive in row slices
    linear.bias.data.normal_()
    path, x = export_one_linear(tmp_path, linear)
    graph = onnx.load(str(path)).graph
    assert [n.op_type for n in graph.node if n.op_type != "Add"] == ["MatMulNBits"]
    assert not any(
        i.data_type == onnx.TensorProto.FLOAT and len(i.dims) == 2 for i in graph.initializer
    )  # no float weight
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ours = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    reference = linear(x).detach().numpy()
    scale = np.abs(reference).max()
    np.testing.assert_allclose(ours, reference, rtol=0, atol=tolerance * scale)


def q4_1_linear() -> QuantizedLinear:
    """A linear with minimums (w = scale * q + minimum per block, GGUF Q4_1): 24 rows with their own fp16 scales and
    minimums, 16 symmetric rows (Q4_0-style: fp16 scales, minimum -8 x scale)."""
    torch.manual_seed(2)
    linear = QuantizedLinear(96, 40, bias=False, dtype=torch.float32, spec=QuantSpec(4, 32, 0, minimums=True))
    qweight, scales = quantize_blockwise(torch.randn(40, 96), 4, 32)
    scales = scales.half().float()
    linear.load_quantized_rows(0, qweight[:24], scales[:72], torch.randn(24, 3).half())
    linear.load_quantized_rows(24, qweight[24:], scales[72:])
    return linear


def test_symmetric_rows_in_a_linear_with_minimums_keep_their_weights():
    linear = q4_1_linear()
    symmetric = dequantize_blockwise(linear.qweight[24:], linear.scales[72:], 96, 4)
    assert torch.equal(dequantize_blockwise(linear.qweight, linear.scales, 96, 4, linear.minimums)[24:], symmetric)
    with pytest.raises(ValueError, match="float16"):  # an RTN scale is no float16: -8 x scale would be rounded
        linear.load_rows(0, torch.randn(4, 96))
    with pytest.raises(ValueError, match="multiple of the block size"):
        QuantizedLinear(100, 8, bias=False, dtype=torch.float32, spec=QuantSpec(4, 32, 0, minimums=True))


def test_minimums_without_our_kernel_add_one_small_float_matmul_and_stay_exact(tmp_path):
    """Exported for onnxruntime's own ops: the fused MatMulNBits plus block sums x (minimum + 8 scale)."""
    import onnx
    import onnxruntime as ort

    linear = q4_1_linear()
    dense = dequantize_blockwise(linear.qweight, linear.scales, 96, 4, linear.minimums)
    path, x = export_one_linear(tmp_path, linear)
    graph = onnx.load(str(path)).graph
    assert sorted(n.op_type for n in graph.node if n.op_type in ("MatMulNBits", "MatMul")) == ["MatMul", "MatMulNBits"]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ours = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    reference = (x @ dense.t()).numpy()
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-5 * np.abs(reference).max())


def test_minimums_with_our_kernel_export_one_node_holding_the_blocks(tmp_path):
    """With `native_minimums` the linear is one Int4MatMul node whose inputs are the blocks as loaded: the codes,
    the scales and the float16 minimums, nothing computed from them."""
    import onnx
    from onnx import numpy_helper

    linear = q4_1_linear()
    linear.native_minimums = True
    path, _ = export_one_linear(tmp_path, linear)
    model = onnx.load(str(path))
    (node,) = [n for n in model.graph.node if n.op_type not in ("Constant", "Identity")]
    assert (node.op_type, node.domain, len(node.input)) == ("Int4MatMul", DOMAIN, 4)
    constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert np.array_equal(constants[node.input[1]], linear.qweight.numpy())
    assert np.array_equal(constants[node.input[2]], linear.scales.numpy())
    assert constants[node.input[3]].dtype == np.float16
    assert np.array_equal(constants[node.input[3]], linear.minimums.numpy())


def test_invalid_specs_are_refused():
    with pytest.raises(ValueError, match="bits"):
        QuantSpec(3, 32)
    with pytest.raises(ValueError, match="group size"):
        QuantSpec(4, 48)


@pytest.mark.parametrize("bits, minimums", [(4, False), (4, True), (8, False)])
def test_an_embedding_table_in_blocks_looks_up_exactly_its_rows_in_onnxruntime(tmp_path, bits, minimums):
    """Its lookup, exported and run by onnxruntime, gives each token's row of the table as numpy dequantizes it
    from the same blocks (scale x (q - zero point), or scale x q + minimum), bit for bit; no float table is stored."""
    import onnx
    import onnxruntime as ort

    vocab, hidden = 37, 96  # an odd vocabulary, three blocks a row
    table = QuantizedEmbedding(vocab, hidden, torch.float32, QuantSpec(bits, 32, minimums=minimums))
    weight = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(3))
    qweight, scales = quantize_blockwise(weight, bits, 32)
    mins = None
    if minimums:
        scales = scales.half().float()
        mins = torch.randn(vocab, 3, generator=torch.Generator().manual_seed(4)).half()
    table.load_quantized_rows(0, qweight, scales, mins)

    q, _ = numpy_reference_quantize(weight.numpy(), bits, 32)
    if bits == 4:
        q = np.stack([q & 15, q >> 4], -1).reshape(vocab, 3, 32)
    q, scale = q.astype(np.float32), scales.numpy().reshape(vocab, 3, 1)
    values = q * scale + mins.numpy().astype(np.float32)[..., None] if minimums else (q - 2 ** (bits - 1)) * scale
    expected_table = values.reshape(vocab, hidden)

    ids = torch.tensor([[5, 0, 36, 5], [12, 12, 1, 30]])
    path = tmp_path / "embedding.onnx"
    torch.onnx.export(
        table.eval(),
        (ids,),
        str(path),
        dynamo=True,
        dynamic_shapes=({0: torch.export.Dim("b"), 1: torch.export.Dim("t")},),
    )
    graph = onnx.load(str(path)).graph
    stored = {i.name: onnx.numpy_helper.to_array(i) for i in graph.initializer}
    assert not [name for name, value in stored.items() if value.dtype == np.float32 and value.size >= vocab * hidden]
    assert sum(value.nbytes for value in stored.values()) <= table.stored_bytes() + table.byte_values().nbytes + 64
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for rows in (ids, ids[:1, :3]):
        ours = session.run(None, {session.get_inputs()[0].name: rows.numpy()})[0]
        np.testing.assert_array_equal(ours, expected_table[rows.numpy()])
    assert table.stored_bytes() == qweight.numel() + 4 * scales.numel() + (2 * mins.numel() if minimums else 0)
