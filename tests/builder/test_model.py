"""Pieces of the model that the parity tests would only catch indirectly."""

import torch

from builder.model import rope_inv_freq, rotary_tables
from builder.phases import BuildShapes, batch_sizes, default_prefill_chunk, kv_ladder, plan_phases, verify_steps
from engines.model_config import ModelConfig, RopeScaling
from plugins.attention import rotate


def test_rotary_tables_and_rotation_are_those_of_transformers():
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    hf = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=2, max_position_embeddings=512, rope_theta=10000.0
    )
    config = ModelConfig(
        vocab_size=8,
        hidden_size=64,
        intermediate_size=8,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    positions = torch.tensor([[0, 1, 7, 300, 511]])
    x = torch.randn(1, 1, 5, 32)
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf)(x, positions)
    cos, sin = rotary_tables(config, 512, torch.float32)
    # (our inverse frequencies are computed in float64, transformers' in float32: angles differ by ~2e-6 at 511)
    torch.testing.assert_close(torch.cat((cos, cos), -1)[positions], hf_cos, rtol=0, atol=4e-6)
    torch.testing.assert_close(torch.cat((sin, sin), -1)[positions], hf_sin, rtol=0, atol=4e-6)
    expected, _ = apply_rotary_pos_emb(x, x, hf_cos, hf_sin)
    torch.testing.assert_close(rotate(x, cos[positions], sin[positions]), expected)


def test_llama3_rope_scaling_only_slows_low_frequencies():
    base = dict(
        vocab_size=8,
        hidden_size=64,
        intermediate_size=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    plain = rope_inv_freq(ModelConfig(**base))
    scaled = rope_inv_freq(ModelConfig(**base, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64)))
    assert torch.equal(scaled[0], plain[0])  # highest frequency untouched
    torch.testing.assert_close(scaled[-1], plain[-1] / 8.0)  # lowest divided by the factor


def test_bucket_plan():
    assert kv_ladder(64, 2048) == [64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    phases = plan_phases(BuildShapes(max_seq_len=1000, max_batch=6, prefill_chunk=100))
    assert phases["decode"].batch_sizes == [1, 2, 3, 4, 5, 6]
    assert batch_sizes(40) == [*range(1, 17), 24, 32, 40] and verify_steps(25) == [*range(1, 17), 20, 24, 25]
    assert phases["prefill"].steps == list(range(1, 101))  # a chunk is never padded
    assert phases["decode"].past_lengths[-1] == 1000
    assert phases["verify"].steps == [1, 2, 3, 4, 5, 6, 7, 8] and phases["verify"].logits == "all"
    # a long chunk prefills a prompt alone; score calls return logits at every position and keep to 128
    long_chunks = plan_phases(BuildShapes(max_seq_len=2048, prefill_chunk=1024))
    assert long_chunks["prefill"].steps[-1] == 1024 and long_chunks["score"].steps[-1] == 128


def test_the_largest_prefill_chunk_is_long_unless_the_kv_cache_is_int8():
    # one long chunk reads the weights once; onnxruntime's int8-cache attention slows down with the chunk's length
    assert default_prefill_chunk("auto", 2048) == 1024
    assert default_prefill_chunk("auto", 256) == 256
    assert default_prefill_chunk("int8", 2048) == 128
