"""The residual add + RMSNorm plugin: its reference against the com.microsoft::SkipSimplifiedLayerNormalization node
it is lowered to, and against transformers' RMSNorm."""

from __future__ import annotations

import numpy as np
import torch

from plugins.norm import add_rms_norm, onnx_translations, rms_norm


class AddNorm(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x, residual):
        return add_rms_norm(x, residual, self.weight, 1e-5)


def test_onnx_lowering_is_one_fused_node_giving_the_norm_and_the_sum(tmp_path):
    import onnx
    import onnxruntime as ort

    generator = torch.Generator().manual_seed(0)
    x, residual = torch.randn(2, 3, 40, generator=generator), torch.randn(2, 3, 40, generator=generator) * 4
    module = AddNorm(torch.rand(40, generator=generator) + 0.5).eval()
    path = tmp_path / "norm.onnx"
    torch.onnx.export(module, (x, residual), str(path), dynamo=True, custom_translation_table=onnx_translations())
    assert [n.op_type for n in onnx.load(str(path)).graph.node] == ["SkipSimplifiedLayerNormalization"]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    normed, total = session.run(None, dict(zip([i.name for i in session.get_inputs()], (x.numpy(), residual.numpy()))))
    ref_normed, ref_total = module(x, residual)
    np.testing.assert_allclose(total, ref_total.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(normed, ref_normed.numpy(), rtol=0, atol=1e-5)


def test_reference_is_transformers_rms_norm_of_the_sum():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, residual = torch.randn(4, 64), torch.randn(4, 64)
    hf = LlamaRMSNorm(64, eps=1e-6)
    hf.weight.data.uniform_(0.5, 1.5)
    normed, total = add_rms_norm(x, residual, hf.weight.data, 1e-6)
    torch.testing.assert_close(total, x + residual)
    torch.testing.assert_close(normed, hf(x + residual))
    torch.testing.assert_close(rms_norm(x, hf.weight.data, 1e-6), hf(x))
