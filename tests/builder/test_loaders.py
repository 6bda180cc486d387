"""Checkpoint loaders: HF directories (single, sharded), GGUF layout details, and clear errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from builder.loaders import CheckpointError, load_checkpoint
from builder.loaders.gguf_file import hf_tensor_name, unpermute_rows
from builder.weights import load_model


def test_hf_directory_config_and_lazy_tensors(checkpoint_factory):
    checkpoint = load_checkpoint(checkpoint_factory("gqa"))
    config = checkpoint.config
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 16)
    assert config.tie_word_embeddings and config.eos_token_ids == (2,)
    assert checkpoint.tokenizer.chat_template and checkpoint.tokenizer.eos_token == "<|im_end|>"
    names = [name for name, _ in checkpoint.read_tensors()]
    assert "model.layers.1.mlp.down_proj.weight" in names


def test_sharded_checkpoint_loads_the_same_weights(checkpoint_factory):
    single = dict(load_checkpoint(checkpoint_factory("gqa")).read_tensors())
    sharded_dir = checkpoint_factory("gqa", shards=3)
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    sharded = dict(load_checkpoint(sharded_dir).read_tensors())
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[k], sharded[k]) for k in single)


def test_llama3_rope_scaling_is_read(checkpoint_factory):
    scaling = load_checkpoint(checkpoint_factory("rope_scaling")).config.rope_scaling
    assert scaling is not None and scaling.factor == 8.0


def test_recommended_sampling_from_generation_config_and_gguf(checkpoint_factory, tmp_path):
    """generation_config.json's sampling fields as vLLM's --generation-config auto reads them (a field at
    transformers' own default is no recommendation; max_new_tokens is max_tokens), and a GGUF's general.sampling.*."""
    source = tmp_path / "ckpt"
    shutil.copytree(checkpoint_factory("gqa"), source)
    assert load_checkpoint(source).sampling_defaults == {}  # transformers writes bos / eos ids only
    generation = json.loads((source / "generation_config.json").read_text())
    generation.update(temperature=0.6, top_p=0.9, top_k=50, repetition_penalty=1.0, min_p=0.05, max_new_tokens=64)
    (source / "generation_config.json").write_text(json.dumps(generation))
    assert load_checkpoint(source).sampling_defaults == {
        "temperature": 0.6,
        "top_p": 0.9,
        "min_p": 0.05,
        "max_tokens": 64,
    }
    from tests.tiny_checkpoint import make_gguf

    gguf = make_gguf(tmp_path / "tiny.gguf", source, sampling={"temp": 0.7, "top_k": 20, "penalty_repeat": 1.1})
    assert load_checkpoint(gguf).sampling_defaults == {"temperature": 0.7, "top_k": 20, "repetition_penalty": 1.1}


def test_missing_path():
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint("/nonexistent/model")


def copy_with_config(source, directory, edit):
    """A copy of a checkpoint directory whose config.json is changed by `edit(config)`."""
    shutil.copytree(source, directory)
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_unsupported_architecture(checkpoint_factory, tmp_path):
    edit = lambda config: config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])  # noqa: E731
    directory = copy_with_config(checkpoint_factory("gqa"), tmp_path / "gpt2", edit)
    with pytest.raises(CheckpointError, match="unsupported architecture.*gpt2"):
        load_checkpoint(directory)


def test_qwen2_and_mistral_read_as_llama_with_their_biases_and_window(checkpoint_factory, tmp_path):
    """Qwen2: q/k/v biases, none on o_proj; Mistral: a sliding window, which the engine does not implement, so a
    build longer than it is refused (up to it, attention is the same); Qwen2's window counts only when used."""
    from builder.build import BuildOptions, build_engine

    qwen = load_checkpoint(checkpoint_factory("qwen2")).config
    assert (qwen.attention_bias, qwen.o_proj_bias, qwen.sliding_window) == (True, False, None)
    llama = load_checkpoint(checkpoint_factory("untied_bias")).config
    assert (llama.attention_bias, llama.o_proj_bias) == (True, True)
    windowed = copy_with_config(
        checkpoint_factory("mistral"), tmp_path / "mistral", lambda c: c.update(sliding_window=64)
    )
    assert load_checkpoint(windowed).config.sliding_window == 64
    with pytest.raises(ValueError, match="sliding window of 64"):
        build_engine(BuildOptions(str(windowed), tmp_path / "engine", "fp32", 128, 1, 32), log=lambda line: None)
    used = copy_with_config(
        checkpoint_factory("qwen2"), tmp_path / "qwen", lambda c: c.update(use_sliding_window=True, sliding_window=64)
    )
    assert load_checkpoint(used).config.sliding_window == 64


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_a_qwen_gguf_is_the_same_model_as_its_hf_checkpoint(arch, checkpoint_factory, tmp_path):
    """llama.cpp writes Qwen2 / Qwen3 under their own architectures (their keys, Q/K rows not permuted, Qwen3's
    attn_q_norm / attn_k_norm): with float tensors the GGUF's engine and the HF checkpoint's compute the same
    logits. Qwen's pre-tokenizer splits every digit."""
    from builder.build import BuildOptions, build_engine
    from builder.loaders.gguf_file import _pre_tokenizer
    from runner.core.args import EngineArgs
    from runner.core.engine import LLMEngine
    from tests.tiny_checkpoint import make_gguf

    source = checkpoint_factory(arch)
    gguf = make_gguf(tmp_path / f"{arch}.gguf", source, linear_type="F32", embedding_type="F32", arch=arch)
    config = load_checkpoint(gguf).config
    assert (config.attention_bias, config.o_proj_bias, config.qk_norm) == (arch == "qwen2", False, arch == "qwen3")
    assert config.rope_theta == load_checkpoint(source).config.rope_theta == 1e6  # both families' value
    engines = []
    for name, path in (("hf", source), ("gguf", gguf)):
        build_engine(BuildOptions(str(path), tmp_path / name, "fp32", 64, 1, 32), log=lambda line: None)
        engines.append(LLMEngine(EngineArgs(tmp_path / name)))
    tokens = engines[0].codec.encode("The quick brown fox jumps over the lazy dog.")
    hf, ours = (e.executor.prefill(0, tokens, 0).logits for e in engines)
    np.testing.assert_allclose(ours, hf, rtol=0, atol=1e-4 * np.abs(hf).max())
    pieces = lambda kind: [p for p, _ in _pre_tokenizer(kind, gguf).pre_tokenize_str("in 2024")]  # noqa: E731
    assert pieces("qwen2")[-4:] == ["2", "0", "2", "4"] and pieces("llama3")[-2:] == ["202", "4"]


def test_a_sentencepiece_gguf_tokenizes_as_transformers_reads_it(tmp_path):
    """Llama 2 / Mistral / TinyLlama GGUFs carry a SentencePiece vocabulary (scores, "\u2581" spaces, <0xNN> byte
    tokens, no merges): ours tokenizes and decodes as transformers' own GGUF reader (the reference) does."""
    import gguf
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    pieces = [
        "\u2581",
        *"abcdefghijklmnopqrstuvwxyzHW,!",
        "bc",
        "ab",
        "\u2581t",
        "he",
        "\u2581the",
        "ll",
        "llo",
        "\u2581he",
        "\u2581hello",
        "or",
        "\u2581w",
        "\u2581wor",
        "ld",
        "\u2581world",
        "\u2581a",
        "in",
        "\u2581in",
        "er",
    ]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    path = tmp_path / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in (
        (writer.add_block_count, 1),
        (writer.add_context_length, 64),
        (writer.add_embedding_length, 64),
        (writer.add_feed_forward_length, 96),
        (writer.add_head_count, 4),
        (writer.add_layer_norm_rms_eps, 1e-5),
    ):
        add(value)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    spec = load_checkpoint(path).tokenizer
    ours = Tokenizer.from_str(spec.tokenizer_json)
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert (spec.bos_token, spec.eos_token, spec.add_bos_token) == ("<s>", "</s>", True)
    for text in (
        "xabc cab",
        "the hello world",
        "Hello, world!",
        "in  the  inner",
        " leading space",
        "caf\u00e9 \u2603 x",
        "<s>hello</s>",
    ):
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids), text
    assert ours.encode("the hello world", add_special_tokens=False).tokens == [
        "\u2581the",
        "\u2581hello",
        "\u2581world",
    ]
    assert ours.encode("xabc", add_special_tokens=False).tokens == ["\u2581", "x", "a", "bc"]  # "bc" outranks "ab"
    from engines.format import TokenizerInfo
    from runner.core.tokenizer import IncrementalDetokenizer, TextCodec

    (tmp_path / "tokenizer.json").write_text(spec.tokenizer_json)
    codec = TextCodec(tmp_path / "tokenizer.json", TokenizerInfo("tokenizer.json", None, "<s>", "</s>", True))
    ids = codec.encode("Hello, caf\u00e9 world!")
    assert ids[0] == 1  # the BOS token llama.cpp adds to these vocabularies
    streamed = IncrementalDetokenizer(codec)
    assert (
        "".join(streamed.push(i) for i in ids) == codec.decode(ids) == "Hello, caf\u00e9 world!"
    )  # as the runner streams


def test_malformed_config(checkpoint_factory, tmp_path):
    directory = copy_with_config(
        checkpoint_factory("gqa"), tmp_path / "broken", lambda config: config.pop("hidden_size")
    )
    with pytest.raises(CheckpointError, match="missing 'hidden_size'"):
        load_checkpoint(directory)
    (directory / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match="malformed JSON"):
        load_checkpoint(directory)


def test_missing_tokenizer_and_weights(checkpoint_factory, tmp_path):
    directory = tmp_path / "partial"
    shutil.copytree(checkpoint_factory("gqa"), directory)
    (directory / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load_checkpoint(directory)
    shutil.copy(checkpoint_factory("gqa") / "tokenizer.json", directory)
    (directory / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_checkpoint(directory)


def test_weights_not_matching_the_config(checkpoint_factory, tmp_path):
    edit = lambda config: config.update(intermediate_size=128)  # noqa: E731
    directory = copy_with_config(checkpoint_factory("gqa"), tmp_path / "mismatch", edit)
    checkpoint = load_checkpoint(directory)
    with pytest.raises(CheckpointError, match="has shape"):
        load_model(checkpoint.config, checkpoint.read_tensors(), torch.float32)


def test_gguf_names_map_to_hf_names():
    assert hf_tensor_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("rope_freqs.weight") is None


def test_unpermute_inverts_llama_cpp_permutation():
    heads, head_dim, cols = 3, 8, 5
    weight = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    # llama.cpp's convert script: rotary pairs interleaved within each head
    permuted = weight.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(weight.shape)
    np.testing.assert_array_equal(unpermute_rows(permuted, heads), weight)


def test_corrupt_safetensors(checkpoint_factory, tmp_path):
    directory = tmp_path / "corrupt"
    shutil.copytree(checkpoint_factory("gqa"), directory)
    (directory / "model.safetensors").write_bytes(b"garbage" * 100)
    checkpoint = load_checkpoint(directory)
    with pytest.raises(CheckpointError, match="cannot read .*model.safetensors"):
        load_model(checkpoint.config, checkpoint.read_tensors(), torch.float32)


def test_corrupt_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"garbage" * 100)
    with pytest.raises(CheckpointError, match="cannot read GGUF file"):
        load_checkpoint(path)


def test_not_a_checkpoint(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0")
    with pytest.raises(CheckpointError, match="neither a checkpoint directory nor a .gguf file"):
        load_checkpoint(path)
