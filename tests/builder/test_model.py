"""Pieces of the model that the parity tests would only catch indirectly."""

import torch

from builder.model import rope_inv_freq, rotate_half_matrix
from builder.phases import BuildShapes, kv_ladder, plan_phases
from engines.model_config import ModelConfig, RopeScaling


def test_rotate_half_matrix_is_exactly_rotate_half():
    x = torch.randn(5, 16)
    expected = torch.cat((-x[..., 8:], x[..., :8]), dim=-1)
    assert torch.equal(x @ rotate_half_matrix(16, torch.float32), expected)


def test_llama3_rope_scaling_only_slows_low_frequencies():
    base = dict(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=True)
    plain = rope_inv_freq(ModelConfig(**base))
    scaled = rope_inv_freq(ModelConfig(**base, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64)))
    assert torch.equal(scaled[0], plain[0])  # highest frequency untouched
    torch.testing.assert_close(scaled[-1], plain[-1] / 8.0)  # lowest divided by the factor


def test_bucket_plan():
    assert kv_ladder(64, 2048) == [64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    phases = plan_phases(BuildShapes(max_seq_len=1000, max_batch=6, prefill_chunk=100))
    assert phases["decode"].batch_sizes == [1, 2, 4, 6]
    assert phases["prefill"].steps == [16, 32, 48, 64, 80, 96, 100]
    assert phases["decode"].past_lengths[-1] == 1000
    assert phases["verify"].steps == [1, 2, 4, 8] and phases["verify"].logits == "all"
