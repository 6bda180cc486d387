"""The attention plugin: its torch reference against onnxruntime's fused GroupQueryAttention kernel it is lowered to,
with the cache bound in place as the engine binds it, for every way the engine calls it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from plugins.attention import attend_in_place, check_head_dim, group_query_attention, onnx_translations

HEADS, KV_HEADS, HEAD_DIM, POSITIONS = 4, 2, 16, 64
MASKED = float(np.finfo(np.float32).min)


class OneAttention(torch.nn.Module):
    def forward(
        self,
        qkv,
        past_key,
        past_value,
        seqlens_k,
        total_len,
        cos,
        sin,
        position_ids,
        bias,
        query_lens,
        k_scale=None,
        v_scale=None,
    ):
        return group_query_attention(
            qkv,
            past_key,
            past_value,
            seqlens_k,
            total_len,
            cos,
            sin,
            position_ids,
            bias,
            query_lens,
            HEADS,
            KV_HEADS,
            HEAD_DIM**-0.5,
            k_scale,
            v_scale,
        )


def case(
    past: list[int],
    query: list[int],
    steps: int,
    length: int = 48,
    trees: dict | None = None,
    seed: int = 0,
    int8_cache: bool = False,
):
    """Inputs of one call: rows holding `past` positions adding `query` real tokens each (padded to `steps`)."""
    rng = np.random.default_rng(seed)
    batch = len(past)
    qkv = rng.standard_normal((batch, steps, (HEADS + 2 * KV_HEADS) * HEAD_DIM), dtype=np.float32)
    cache = rng.standard_normal((2, batch, KV_HEADS, length, HEAD_DIM), dtype=np.float32)
    scales = {}
    if int8_cache:  # per-channel scales that clip some new values (|x| > 127 * scale), which unseen inputs may
        scales = {
            name: rng.uniform(0.01, 0.03, (1, KV_HEADS, 1, HEAD_DIM)).astype(np.float32)
            for name in ("k_scale", "v_scale")
        }
        cache = rng.integers(-127, 128, cache.shape).astype(np.int8)
    total = max(past) + steps
    bias = np.zeros((batch, 1, steps, total), np.float32)
    positions = np.zeros((batch, steps), np.int64)
    for row, (p, q) in enumerate(zip(past, query)):
        mask = (trees or {}).get(row, np.tril(np.ones((q, q), bool)))
        positions[row, :q] = p + mask.sum(axis=1) - 1
        bias[row, 0, :q, p : p + q][~mask] = MASKED
    # rotary rows for every position the cache can hold (at least POSITIONS)
    angles = np.arange(max(POSITIONS, length))[:, None] * (1.0 / 10000 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM))[None]
    seqlens = np.maximum(np.array(past) + np.array(query) - 1, 0).astype(np.int32)
    return {
        "qkv": qkv,
        "past_key": cache[0],
        "past_value": cache[1],
        "seqlens_k": seqlens,
        "total_len": np.array(total, np.int32),
        "cos": np.cos(angles).astype(np.float32),
        "sin": np.sin(angles).astype(np.float32),
        "position_ids": positions,
        "bias": bias,
        "query_lens": np.array(query, np.int32),
        **scales,
    }


def run_onnxruntime(tmp_path, inputs: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """Export the op alone, run it with past and present bound to the same buffers (as the runner does)."""
    import onnx
    import onnxruntime as ort

    args = tuple(torch.from_numpy(v) for v in inputs.values())
    path = tmp_path / "attention.onnx"
    torch.onnx.export(
        OneAttention().eval(),
        args,
        str(path),
        dynamo=True,
        custom_translation_table=onnx_translations(),
        input_names=list(inputs),
        output_names=["out", "present_key", "present_value"],
    )
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    return *run_in_place(ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]), inputs), ops


def run_in_place(session, inputs: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run an attention graph with past and present bound to copies of the cache: (out, keys, values)."""
    keys, values = inputs["past_key"].copy(), inputs["past_value"].copy()
    binding = session.io_binding()
    for name, value in inputs.items():
        if name not in ("past_key", "past_value"):
            binding.bind_cpu_input(name, value)
    for past, present, buffer in (("past_key", "present_key", keys), ("past_value", "present_value", values)):
        binding.bind_input(past, "cpu", 0, buffer.dtype, list(buffer.shape), buffer.ctypes.data)
        binding.bind_output(present, "cpu", 0, buffer.dtype, list(buffer.shape), buffer.ctypes.data)
    binding.bind_output("out", "cpu")
    session.run_with_iobinding(binding)
    return binding.get_outputs()[-1].numpy(), keys, values


CASES = {
    "first prompt chunk, padded": dict(past=[0], query=[11], steps=16),
    "later prompt chunk": dict(past=[20], query=[16], steps=16),
    "decode, three rows, one idle": dict(past=[5, 9, 17], query=[1, 0, 1], steps=1),
    "decode, idle row with an empty cache": dict(past=[12, 0], query=[1, 0], steps=1),
    # row 0: a root with two children, the second with a child of its own; row 1: a chain of two, padded
    "tree verify, two rows": dict(
        past=[9, 30],
        query=[4, 2],
        steps=4,
        trees={0: np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], bool)},
    ),
}


@pytest.mark.parametrize("int8_cache", [False, True], ids=["float cache", "int8 cache"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_onnx_lowering_is_one_fused_node_matching_the_reference_in_place(tmp_path, name, int8_cache):
    inputs = case(**CASES[name], int8_cache=int8_cache)
    out, keys, values, ops = run_onnxruntime(tmp_path, inputs)
    assert ops == ["GroupQueryAttention"]
    assert_onnxruntimes_kernel_computed_the_reference(inputs, out, keys, values, CASES[name]["query"])


def assert_onnxruntimes_kernel_computed_the_reference(inputs: dict, out, keys, values, query: list[int]) -> None:
    """The cache: real tokens written at past + t, padding and idle rows leave it as it was; an int8 cache may round
    a value sitting on a rounding boundary the other way (onnxruntime's x * (1 / scale) against x / scale), and
    attention then reads what the kernel wrote. The outputs of real tokens (padding tokens' are unspecified)."""
    ref_out, ref_keys, ref_values = (t.numpy() for t in OneAttention()(*(torch.from_numpy(v) for v in inputs.values())))
    int8_cache = "k_scale" in inputs
    assert keys.dtype == values.dtype == inputs["past_key"].dtype
    for written, expected in ((keys, ref_keys), (values, ref_values)):
        np.testing.assert_allclose(
            written.astype(np.float32), expected.astype(np.float32), rtol=0, atol=1 if int8_cache else 1e-6
        )
    if int8_cache:
        assert (keys != inputs["past_key"]).any() and (keys != ref_keys).mean() < 0.01
        ref_out = OneAttention()(
            *(torch.from_numpy(v) for v in dict(inputs, past_key=keys, past_value=values).values())
        )[0].numpy()
    for row, q in enumerate(query):
        np.testing.assert_allclose(out[row, :q], ref_out[row, :q], rtol=0, atol=2e-5)


@pytest.mark.parametrize("int8_cache", [False, True], ids=["float cache", "int8 cache"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_in_place_variant_matches_the_reference_and_writes_the_buffers_it_was_given(name, int8_cache):
    """The torch backends' attention: same outputs and cache as the reference, the cache written into the very
    tensors passed in (nothing else changed: padding tokens and idle rows included)."""
    inputs = case(**CASES[name], int8_cache=int8_cache)
    args = [torch.from_numpy(v.copy()) for v in inputs.values()]
    ref_out, ref_keys, ref_values = OneAttention()(*(torch.from_numpy(v) for v in inputs.values()))
    keys, values = args[1], args[2]
    scales = args[10:] if int8_cache else [None, None]
    out, present_key, present_value = attend_in_place(*args[:10], HEADS, KV_HEADS, HEAD_DIM**-0.5, *scales)
    assert present_key is keys and present_value is values
    torch.testing.assert_close(keys, ref_keys, rtol=0, atol=0)
    torch.testing.assert_close(values, ref_values, rtol=0, atol=0)
    for row, q in enumerate(CASES[name]["query"]):
        torch.testing.assert_close(out[row, :q], ref_out[row, :q], rtol=0, atol=2e-5)


def test_reference_writes_only_real_tokens_and_attends_causally():
    inputs = case(past=[3, 6], query=[2, 0], steps=3)
    out, keys, values = OneAttention()(*(torch.from_numpy(v) for v in inputs.values()))
    before = inputs["past_value"]
    changed = (values.numpy() != before).any(axis=(1, 3))  # [rows, positions]
    assert changed[0].nonzero()[0].tolist() == [3, 4] and not changed[1].any()
    # token 0 of row 0 sees positions 0..3 only: the values at 4 (token 1's) must not move its output
    altered = dict(inputs, qkv=inputs["qkv"].copy())
    altered["qkv"][0, 1, (HEADS + KV_HEADS) * HEAD_DIM :] += 10.0
    out_altered = OneAttention()(*(torch.from_numpy(v) for v in altered.values()))[0]
    torch.testing.assert_close(out_altered[0, 0], out[0, 0])
    assert not torch.allclose(out_altered[0, 1], out[0, 1])


def test_head_dims_the_kernel_refuses_are_refused_at_build_time():
    check_head_dim(64)
    with pytest.raises(ValueError, match="multiple of 16"):
        check_head_dim(8)
