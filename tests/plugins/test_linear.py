"""The linear plugin keeps the Hugging Face weight layout, so checkpoints load into it by name."""

import torch

from plugins.linear import make_linear


def test_float_linear_matches_torch_linear_in_hf_layout():
    torch.manual_seed(0)
    layer = make_linear(6, 4, bias=True, dtype=torch.float32)
    assert layer.weight.shape == (4, 6) and layer.bias.shape == (4,)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(2, 3, 6)
    torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias)
