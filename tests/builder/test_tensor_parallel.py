"""The sharding of a model over tensor-parallel ranks (builder/tensor_parallel.py): shares, cuts, and the sharded
model's logits against transformers with the ranks' collectives run by torch.distributed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from builder.build import BuildOptions, build_engine
from builder.loaders import load_checkpoint
from builder.loaders.gguf_blocks import BlockQuantized
from builder.tensor_parallel import (
    add_collectives,
    head_rows,
    plan_shares,
    rank_config,
    shard_kv_scales,
    shard_quantized,
    shard_tensors,
    split,
)
from builder.weights import load_model
from engines.model_config import ModelConfig
from tests.reference import load_reference

SMOLLM2 = ModelConfig(49152, 576, 1536, 30, 9, 3, 64, 1e-5, 100000.0, 8192, True)


def test_the_default_models_heads_split_by_kv_group_two_plus_one():
    shares = plan_shares(SMOLLM2, 2)
    assert [(s.kv_heads, s.heads, s.intermediate, s.vocab) for s in shares] == [
        ((0, 2), (0, 6), (0, 768), (0, 24576)),
        ((2, 3), (6, 9), (768, 1536), (24576, 49152)),
    ]
    assert rank_config(SMOLLM2, shares[1]).num_heads == 3 and not rank_config(SMOLLM2, shares[1]).tie_word_embeddings


def test_uneven_splits_give_the_first_ranks_more_in_whole_units():
    assert split(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split(96, 2, 32) == [(0, 64), (64, 96)]


def test_more_ranks_than_kv_heads_are_refused():
    with pytest.raises(ValueError, match="3 KV heads"):
        plan_shares(SMOLLM2, 4)


def test_an_int8_kv_caches_scales_are_cut_by_kv_head():
    shares = plan_shares(SMOLLM2, 2)  # KV heads 0..1 and 2
    scales = [(np.random.rand(1, 3, 1, 64).astype(np.float32), np.random.rand(1, 3, 1, 64).astype(np.float32))] * 2
    cut = [shard_kv_scales(scales, share) for share in shares]
    assert [k.shape[1] for k, _ in (rank[0] for rank in cut)] == [2, 1]
    for layer, (k, v) in enumerate(scales):
        np.testing.assert_array_equal(np.concatenate([rank[layer][0] for rank in cut], axis=1), k)
        np.testing.assert_array_equal(np.concatenate([rank[layer][1] for rank in cut], axis=1), v)


def test_quantized_linears_are_cut_as_their_float_weights_are():
    """GPTQ's fused q/k/v and gate/up rows per part, o and down by whole blocks of inputs, the head by vocabulary,
    the embedding table whole: each block's scale says which row and block of the whole weight it was."""
    config, group = SMOLLM2, 32
    shapes = {
        "model.layers.0.self_attn.qkv_proj": (960, 576),
        "model.layers.0.self_attn.o_proj": (576, 576),
        "model.layers.0.mlp.gate_up_proj": (3072, 576),
        "model.layers.0.mlp.down_proj": (576, 1536),
        "lm_head": (49152, 576),
        "model.embed_tokens": (49152, 576),
    }

    def labelled(rows, inputs):  # block b of row r: scale r * 100 + b, its bytes r % 256
        blocks = inputs // group
        scales = (np.arange(rows)[:, None] * 100 + np.arange(blocks)[None, :]).astype(np.float32)
        qweight = np.broadcast_to((np.arange(rows) % 256).astype(np.uint8)[:, None, None], (rows, blocks, group // 2))
        return qweight.copy(), scales.reshape(-1)

    whole = {name: labelled(*shape) for name, shape in shapes.items()}
    share = plan_shares(config, 2)[1]  # KV head 2, query heads 6..8, MLP 768..1535, vocabulary 24576..49151
    cut = shard_quantized(whole, config, share)

    def rows_and_blocks(name):
        qweight, scales = cut[name]
        labels = scales.reshape(qweight.shape[0], -1)
        np.testing.assert_array_equal(qweight[:, 0, 0], (labels[:, 0] // 100).astype(np.int64) % 256)
        return (labels[:, 0] // 100).astype(int).tolist(), (labels[0] % 100).astype(int).tolist()

    q, k, v = list(range(384, 576)), list(range(576 + 128, 576 + 192)), list(range(768 + 128, 768 + 192))
    assert rows_and_blocks("model.layers.0.self_attn.qkv_proj") == (q + k + v, list(range(18)))
    assert rows_and_blocks("model.layers.0.self_attn.o_proj") == (list(range(576)), list(range(12, 18)))
    gate_up = list(range(768, 1536)) + list(range(1536 + 768, 3072))
    assert rows_and_blocks("model.layers.0.mlp.gate_up_proj") == (gate_up, list(range(18)))
    assert rows_and_blocks("model.layers.0.mlp.down_proj") == (list(range(576)), list(range(24, 48)))
    assert rows_and_blocks("lm_head")[0] == list(range(24576, 49152))
    assert rows_and_blocks("model.embed_tokens")[0] == list(range(49152))
    blocks_of_256 = (np.zeros((576, 3, 128), np.uint8), np.zeros(576 * 3, np.float32))  # o_proj's inputs
    with pytest.raises(ValueError, match="cannot be cut at input 384..576"):
        shard_quantized({"model.layers.0.self_attn.o_proj": blocks_of_256}, config, share)


def test_gguf_blocks_are_cut_at_block_boundaries_bit_for_bit():
    gguf = pytest.importorskip("gguf")
    weight = np.random.default_rng(0).standard_normal((128, 128)).astype(np.float32)
    blocks = BlockQuantized("Q4_1", gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q4_1), 128)
    share = plan_shares(ModelConfig(8, 128, 128, 1, 2, 2, 64, 1e-5, 1e4, 16, False), 2)[1]  # inner width 64..128
    (_, cut), *_ = shard_tensors([("model.layers.0.mlp.down_proj.weight", blocks)], SMOLLM2, share)
    assert isinstance(cut, BlockQuantized) and cut.shape == (128, 64)
    assert torch.equal(cut.dequantize(), blocks.dequantize()[:, 64:])
    (_, rows), *_ = shard_tensors([("model.layers.0.mlp.up_proj.weight", blocks)], SMOLLM2, share)
    assert rows.shape == (64, 128) and torch.equal(rows.dequantize(), blocks.dequantize()[64:])


def _rank_logits(rank: int, ranks: int, checkpoint: str, port: int, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    source = load_checkpoint(checkpoint)
    share = plan_shares(source.config, ranks)[rank]
    tensors = shard_tensors(source.read_tensors(), source.config, share)
    model = load_model(rank_config(source.config, share), tensors, torch.float32, head_rows=head_rows(share))
    add_collectives(model, share, source.config.vocab_size)
    ids = torch.tensor([[5, 9, 31, 7, 200, 11]])
    config = model.config
    cache = [torch.zeros(1, config.num_kv_heads, 16, config.head_dim) for _ in range(config.num_layers)]
    steps = ids.shape[1]
    with torch.no_grad():
        logits = model(
            ids,
            torch.arange(steps)[None],
            torch.tensor([0]),
            torch.tensor([steps]),
            torch.zeros(1, 1, steps, steps),
            torch.arange(steps)[None],
            cache,
            [c.clone() for c in cache],
        )[0]
    if rank == 0:
        torch.save(logits, out)
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("name", ["gqa", "three_kv_heads"])
def test_sharded_models_logits_equal_transformers(checkpoint_factory, tmp_path, name):
    from tests.runner.serving.test_server import free_port

    checkpoint = checkpoint_factory(name)
    out = tmp_path / "logits.pt"
    torch.multiprocessing.spawn(_rank_logits, args=(2, str(checkpoint), free_port(), str(out)), nprocs=2)
    reference = load_reference(checkpoint)
    with torch.no_grad():
        expected = reference(torch.tensor([[5, 9, 31, 7, 200, 11]])).logits
    torch.testing.assert_close(torch.load(out), expected, rtol=0, atol=1e-4)


def test_builds_a_sharded_build_does_not_make_are_refused_before_any_work(checkpoint_factory, tmp_path):
    source = str(checkpoint_factory("gqa"))
    for options, message in ((dict(backend="aoti"), "onnxruntime engines only"),):
        with pytest.raises(ValueError, match=message):
            build_engine(BuildOptions(source, tmp_path / "e", tensor_parallel=2, **options), log=lambda line: None)
