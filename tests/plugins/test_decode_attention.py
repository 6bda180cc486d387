"""DecodeAttention, our onnxruntime CPU kernel for decode steps, verify trees and short prompt chunks: the onnxruntime
ABI positions it relies on, the kernel against the attention plugin's torch reference (cache bound in place as the
engine binds it, and not), over a float cache and an int8 one, a verify tree's tokens against decode steps of them bit
for bit, and an engine whose decode phase runs it against transformers."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from plugins import native_ops
from runner.core.machine import cpu_flags
from tests.plugins.test_attention import (
    CASES,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    MASKED,
    OneAttention,
    assert_onnxruntimes_kernel_computed_the_reference,
    case,
    run_in_place,
)
from tests.reference import load_reference, reference_greedy

needs_compiler = pytest.mark.skipif(
    native_ops.unavailable_reason() is not None,
    reason=f"our kernels cannot be built here: {native_ops.unavailable_reason()}",
)


def onnxruntime_api():
    """onnxruntime's OrtApi table (from the C API library its wheel ships beside the Python module), and a caller."""
    import onnxruntime

    capi = Path(onnxruntime.__file__).parent / "capi"
    lib = ctypes.CDLL(str(sorted(capi.glob("libonnxruntime.so*"))[0]))
    lib.OrtGetApiBase.restype = ctypes.POINTER(ctypes.c_void_p * 2)
    get_api = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32)(lib.OrtGetApiBase().contents[0])
    table = ctypes.cast(get_api(17), ctypes.POINTER(ctypes.c_void_p * 300)).contents
    return lambda index, result, *args: ctypes.CFUNCTYPE(result, *args)(table[index])


def kernel_positions() -> dict[str, int]:
    return {name: int(index) for name, index in re.findall(r"API_(\w+) = (\d+)", native_ops.ABI_HEADER.read_text())}


def kernel_constants() -> dict[str, int]:
    return {name: int(value) for name, value in re.findall(r"\b(ATTR_\w+) = (\d+)", native_ops.ABI_HEADER.read_text())}


def test_the_onnxruntime_functions_the_kernel_calls_sit_where_it_calls_them():
    """The kernel reaches onnxruntime through positions in its function table: each is checked here by what the
    function does (the kernel's own calls of the KernelContext / KernelInfo ones are checked by running it below)."""
    at, call = kernel_positions(), onnxruntime_api()
    p, size = ctypes.c_void_p, ctypes.c_size_t
    status = call(at["CreateStatus"], p, ctypes.c_int, ctypes.c_char_p)(1, b"a message")
    assert call(2, ctypes.c_char_p, p)(status) == b"a message"  # GetErrorMessage: CreateStatus made that status
    call(at["ReleaseStatus"], None, p)(status)
    memory = p()
    assert (
        call(69, p, ctypes.c_int, ctypes.c_int, ctypes.POINTER(p))(1, 0, ctypes.byref(memory)) is None
    )  # CpuMemoryInfo
    array = np.zeros((2, 3), np.float32)
    value = p()
    shape = (ctypes.c_int64 * 2)(2, 3)
    assert (
        call(49, p, p, p, size, p, size, ctypes.c_int, ctypes.POINTER(p))(
            memory, array.ctypes.data, array.nbytes, shape, 2, 1, ctypes.byref(value)
        )
        is None
    )  # a tensor over `array`
    data = p()
    assert call(at["GetTensorMutableData"], p, p, ctypes.POINTER(p))(value, ctypes.byref(data)) is None
    assert data.value == array.ctypes.data
    info, rank, dims = p(), size(), (ctypes.c_int64 * 2)()
    assert call(at["GetTensorTypeAndShape"], p, p, ctypes.POINTER(p))(value, ctypes.byref(info)) is None
    assert (
        call(at["GetDimensionsCount"], p, p, ctypes.POINTER(size))(info, ctypes.byref(rank)) is None and rank.value == 2
    )
    assert call(at["GetDimensions"], p, p, p, size)(info, dims, 2) is None and list(dims) == [2, 3]
    element_type = ctypes.c_int()
    assert (
        call(at["GetTensorElementType"], p, p, ctypes.POINTER(ctypes.c_int))(info, ctypes.byref(element_type)) is None
    )
    assert element_type.value == 1  # float
    call(at["ReleaseTensorTypeAndShapeInfo"], None, p)(info)
    options, domain = p(), p()
    assert call(10, p, ctypes.POINTER(p))(ctypes.byref(options)) is None  # CreateSessionOptions
    assert (
        call(at["CreateCustomOpDomain"], p, ctypes.c_char_p, ctypes.POINTER(p))(b"test", ctypes.byref(domain)) is None
    )
    assert call(at["AddCustomOpDomain"], p, p, p)(options, domain) is None
    attribute, one = p(), ctypes.c_int64(1)
    assert (
        call(at["CreateOpAttr"], p, ctypes.c_char_p, p, ctypes.c_int, ctypes.c_int, ctypes.POINTER(p))(
            b"num_heads", ctypes.addressof(one), 1, 1, ctypes.byref(attribute)
        )
        is None
        and attribute.value
    )
    call(at["ReleaseOpAttr"], None, p)(attribute)
    name = b"PER_CHANNEL"  # a string attribute, as the kernel makes one for an int8 cache's GroupQueryAttention
    assert (
        call(at["CreateOpAttr"], p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.POINTER(p))(
            b"k_quant_type", name, len(name), kernel_constants()["ATTR_STRING"], ctypes.byref(attribute)
        )
        is None
        and attribute.value
    )
    call(at["ReleaseOpAttr"], None, p)(attribute)
    # KernelContext_ParallelFor follows SetDeterministicCompute (273), which takes session options and a flag
    assert at["KernelContext_ParallelFor"] == 274 and call(273, p, p, ctypes.c_bool)(options, True) is None


NAMES = ["qkv", "past_key", "past_value", "seqlens_k", "total_len", "cos", "sin", "position_ids", "bias", "query_lens"]
SCALES = ["k_scale", "v_scale"]  # an int8 cache's


def input_names(inputs: dict) -> list[str]:
    return NAMES + (SCALES if "k_scale" in inputs else [])


def one_node_graph(path: Path, inputs: dict) -> None:
    """One DecodeAttention node (DecodeAttentionInt8Cache where `inputs` hold an int8 cache's scales)."""
    import onnx
    from onnx import TensorProto, helper

    types = {
        np.float32: TensorProto.FLOAT,
        np.int8: TensorProto.INT8,
        np.int32: TensorProto.INT32,
        np.int64: TensorProto.INT64,
    }
    names = input_names(inputs)
    cache_type = types[inputs["past_key"].dtype.type]
    node = helper.make_node(
        "DecodeAttentionInt8Cache" if "k_scale" in inputs else "DecodeAttention",
        names,
        ["out", "present_key", "present_value"],
        domain=native_ops.DOMAIN,
        num_heads=HEADS,
        kv_num_heads=KV_HEADS,
        scale=HEAD_DIM**-0.5,
    )
    graph = helper.make_graph(
        [node],
        "one",
        [helper.make_tensor_value_info(n, types[inputs[n].dtype.type], inputs[n].shape) for n in names],
        [
            helper.make_tensor_value_info("out", TensorProto.FLOAT, None),
            *(helper.make_tensor_value_info(n, cache_type, None) for n in ("present_key", "present_value")),
        ],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(native_ops.DOMAIN, 1)]
    )
    onnx.save(model, str(path))


def run_kernel(tmp_path: Path, library: Path, inputs: dict, in_place: bool):
    """(out, keys, values) of one DecodeAttention node, the cache bound in place as the engine binds it, or not."""
    import onnxruntime as ort

    one_node_graph(tmp_path / "one.onnx", inputs)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.register_custom_ops_library(str(library))
    session = ort.InferenceSession(str(tmp_path / "one.onnx"), options, providers=["CPUExecutionProvider"])
    feeds = {name: inputs[name] for name in input_names(inputs)}
    return run_in_place(session, feeds) if in_place else session.run(None, feeds)


DECODE_CASES = {
    "three rows, one idle": dict(past=[5, 9, 17], query=[1, 0, 1], steps=1),
    "an idle row with an empty cache": dict(past=[12, 0], query=[1, 0], steps=1),
    # several chunks of 128 positions per row, the rows of different lengths (the chunks merge per row)
    "long rows over several chunks": dict(past=[300, 129, 2], query=[1, 1, 1], steps=1, length=320),
}


def assert_cache_written_as_the_reference_writes_it(keys, values, ref_keys, ref_values) -> None:
    """The new K/V at each row's positions, nothing else: a float cache to rounding, an int8 one to the code (the
    kernel rounds x / scale as the reference does, from the same rotated floats)."""
    assert keys.dtype == ref_keys.dtype and values.dtype == ref_values.dtype
    if keys.dtype == np.int8:
        assert np.array_equal(keys, ref_keys) and np.array_equal(values, ref_values)
    else:
        np.testing.assert_allclose(keys, ref_keys, rtol=0, atol=1e-6)
        np.testing.assert_allclose(values, ref_values, rtol=0, atol=1e-6)


CACHES = pytest.mark.parametrize("int8_cache", [False, True], ids=["float cache", "int8 cache"])


@needs_compiler
@CACHES
@pytest.mark.parametrize("in_place", [True, False], ids=["cache bound in place", "cache copied"])
@pytest.mark.parametrize("name", sorted(DECODE_CASES))
def test_the_kernel_computes_what_the_reference_computes(tmp_path, library, name, in_place, int8_cache):
    inputs = case(**DECODE_CASES[name], int8_cache=int8_cache)
    inputs["bias"][0, 0, 0, :3] = MASKED  # row 0 may not see its first positions (a bias the graph could pass)
    out, keys, values = run_kernel(tmp_path, library, inputs, in_place)
    ref_out, ref_keys, ref_values = (t.numpy() for t in OneAttention()(*(torch.from_numpy(v) for v in inputs.values())))
    assert_cache_written_as_the_reference_writes_it(keys, values, ref_keys, ref_values)
    assert int8_cache == (keys.dtype == np.int8)
    for row, q in enumerate(DECODE_CASES[name]["query"]):
        if q:
            np.testing.assert_allclose(out[row], ref_out[row], rtol=0, atol=2e-5)
        else:  # a row that takes no part: zeros (the reference leaves it unspecified)
            assert not out[row].any()
    if not in_place:  # the inputs stay as they were
        assert np.array_equal(inputs["past_key"], case(**DECODE_CASES[name], int8_cache=int8_cache)["past_key"])


SEVERAL_TOKENS = {
    **{name: value for name, value in CASES.items() if value["steps"] > 1},
    # verify trees of several rows over several chunks of 128 positions, one row idle, one padded
    "verify trees over several chunks": dict(past=[150, 0, 260], query=[6, 0, 3], steps=6, length=272),
}


@needs_compiler
@CACHES
@pytest.mark.parametrize("in_place", [True, False], ids=["cache bound in place", "cache copied"])
@pytest.mark.parametrize("name", sorted(SEVERAL_TOKENS))
def test_calls_of_several_tokens_per_row_compute_what_the_reference_computes(
    tmp_path, library, name, in_place, int8_cache
):
    """Verify trees and short prompt chunks run the kernel too: each row's real tokens written at its positions,
    attending causally plus the bias (the trees' masks); padding tokens and idle rows get zeros."""
    inputs = case(**SEVERAL_TOKENS[name], int8_cache=int8_cache)
    out, keys, values = run_kernel(tmp_path, library, inputs, in_place)
    ref_out, ref_keys, ref_values = (t.numpy() for t in OneAttention()(*(torch.from_numpy(v) for v in inputs.values())))
    assert_cache_written_as_the_reference_writes_it(keys, values, ref_keys, ref_values)
    for row, q in enumerate(SEVERAL_TOKENS[name]["query"]):
        np.testing.assert_allclose(out[row, :q], ref_out[row, :q], rtol=0, atol=2e-5)
        assert not out[row, q:].any()


TREES = {
    "a tree": np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 0, 0, 1]], bool),
    # every token sees all before it (a prompt chunk's mask): its blocks score the new tokens with the cached rows
    "a chain": np.tril(np.ones((7, 7), bool)),
}


@needs_compiler
@CACHES
@pytest.mark.parametrize("shape", sorted(TREES))
@pytest.mark.parametrize("past", [21, 125], ids=["within a chunk", "slots across a chunk's end, ancestors not"])
def test_a_verify_trees_tokens_compute_bit_for_bit_what_decode_steps_of_them_compute(
    tmp_path, library, past, shape, int8_cache
):
    """Speculation keeps the plain engine's greedy tokens only if a tree node's attention is exactly what a decode
    step of that token computes once its ancestors are in the cache (at consecutive positions): the same sums in the
    same order and chunks, the other branches weighing exactly nothing. With 125 cached positions node 4 sits in
    slot 129 of the next 128-position chunk, while its decode step has it at position 127. An int8 cache: the same,
    over the int8 rows the verify call wrote."""
    tree = TREES[shape]
    verify = case(past=[past], query=[len(tree)], steps=len(tree), trees={0: tree}, length=160, int8_cache=int8_cache)
    out, keys, values = run_kernel(tmp_path, library, verify, in_place=True)
    for node, path in enumerate(tree):
        ancestors = np.flatnonzero(path)  # in slot order, the node itself last
        decode = case(
            past=[past + len(ancestors) - 1],
            query=[1],
            steps=1,
            length=verify["past_key"].shape[2],
            int8_cache=int8_cache,
        )
        decode.update({name: verify[name] for name in SCALES if int8_cache})
        for name, written in (("past_key", keys), ("past_value", values)):
            decode[name][0, :, :past] = verify[name][0, :, :past]
            decode[name][0, :, past : past + len(ancestors) - 1] = written[0][:, past + ancestors[:-1]]
        decode["qkv"] = verify["qkv"][:, node : node + 1].copy()
        decode["position_ids"] = verify["position_ids"][:, node : node + 1].copy()
        assert decode["position_ids"][0, 0] == past + len(ancestors) - 1
        alone, alone_keys, _ = run_kernel(tmp_path, library, decode, in_place=True)
        assert np.array_equal(alone[0, 0], out[0, node]), node
        assert np.array_equal(alone_keys[0, :, past + len(ancestors) - 1], keys[0, :, past + node])


def avx512() -> bool:
    return "avx512f" in cpu_flags()


@needs_compiler
@pytest.mark.skipif(not avx512(), reason="no AVX-512 here: the kernel runs its 256-bit blocks only")
@CACHES
@pytest.mark.parametrize("name", sorted(SEVERAL_TOKENS))
def test_the_512_bit_blocks_compute_what_the_256_bit_blocks_compute_bit_for_bit(
    tmp_path, library, name, int8_cache, monkeypatch
):
    """Where the CPU has AVX-512, calls of several tokens take blocks of 16 queries on 512-bit vectors instead of 8
    on 256-bit ones: each query's operations are the same, so an engine answers alike on both kinds of CPU (and a
    verify tree's tokens stay what decode steps of them compute)."""
    inputs = case(**SEVERAL_TOKENS[name], int8_cache=int8_cache)
    wide = run_kernel(tmp_path, library, inputs, in_place=True)
    monkeypatch.setenv("LLM_ENGINE_BUILDER_KERNEL_ISA", "avx2")  # read when the session creates the kernel
    again = case(**SEVERAL_TOKENS[name], int8_cache=int8_cache)
    for result, narrow in zip(wide, run_kernel(tmp_path, library, again, in_place=True)):
        assert np.array_equal(result, narrow)


def runs_the_avx512_clone() -> bool:
    """The CPU has what attend_chunk's x86-64-v4 clone needs (AVX-512 F, BW, CD, DQ, VL)."""
    return {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= cpu_flags()


@pytest.fixture(scope="module")
def library_without_the_avx512_clone(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("avx2_clone") / native_ops.LIBRARY_NAME
    return native_ops._compile(target, ('-DATTEND_CLONES="arch=x86-64-v3","default"',))


@needs_compiler
@pytest.mark.skipif(not runs_the_avx512_clone(), reason="no AVX-512 here: the kernel runs its x86-64-v3 clone only")
@CACHES
@pytest.mark.parametrize("name", sorted({**DECODE_CASES, **SEVERAL_TOKENS}))
def test_the_avx512_clone_computes_what_the_avx2_clone_computes_bit_for_bit(
    tmp_path, library, library_without_the_avx512_clone, name, int8_cache
):
    """On AVX-512 CPUs the kernel's loops run a clone compiled for them (more registers, wider conversions of an
    int8 cache's rows): the same operations, so an engine answers alike there and on AVX2-only CPUs."""
    shape = {**DECODE_CASES, **SEVERAL_TOKENS}[name]
    avx512 = run_kernel(tmp_path, library, case(**shape, int8_cache=int8_cache), in_place=True)
    avx2 = run_kernel(tmp_path, library_without_the_avx512_clone, case(**shape, int8_cache=int8_cache), in_place=True)
    for result, expected in zip(avx512, avx2):
        assert np.array_equal(result, expected)


INT8_PROMPT_CHUNKS = {
    "two rows, one padded": dict(past=[7, 40], query=[30, 19], steps=32, length=80),
    # the new tokens' ranks cross a chunk of 128 positions; 128 tokens, the most the kernel takes over an int8 cache
    "across a chunk's end": dict(past=[100, 0], query=[100, 128], steps=128, length=256),
}


@needs_compiler
@pytest.mark.parametrize("name", sorted(INT8_PROMPT_CHUNKS))
def test_prompt_chunks_over_an_int8_cache_run_the_kernel_up_to_128_tokens(tmp_path, library, name):
    """Over an int8 cache the kernel takes prompt chunks too (onnxruntime's int8-cache kernel is the slower one
    there): the codes the reference writes, the reference's attention over them."""
    inputs = case(**INT8_PROMPT_CHUNKS[name], int8_cache=True)
    out, keys, values = run_kernel(tmp_path, library, inputs, in_place=True)
    ref_out, ref_keys, ref_values = (t.numpy() for t in OneAttention()(*(torch.from_numpy(v) for v in inputs.values())))
    assert_cache_written_as_the_reference_writes_it(keys, values, ref_keys, ref_values)
    for row, q in enumerate(INT8_PROMPT_CHUNKS[name]["query"]):
        np.testing.assert_allclose(out[row, :q], ref_out[row, :q], rtol=0, atol=2e-5)
        assert not out[row, q:].any()  # padding tokens: zeros


@needs_compiler
@pytest.mark.parametrize(
    "int8_cache, steps", [(False, 32), (True, 136)], ids=["float cache, over 16 tokens", "int8 cache, over 128"]
)
def test_chunks_longer_than_the_kernel_takes_go_to_onnxruntimes_kernel(tmp_path, library, int8_cache, steps):
    """A prompt chunk longer than the kernel takes (16 tokens a row over a float cache, 128 over an int8 one): the
    node hands it to onnxruntime's GroupQueryAttention, with the same per-channel scales for an int8 cache
    (onnxruntime multiplies by 1 / scale, so a value on a rounding boundary may take the next code)."""
    query = [steps - 2, steps - 13]
    inputs = case(past=[7, 40], query=query, steps=steps, length=steps + 48, int8_cache=int8_cache)
    out, keys, values = run_kernel(tmp_path, library, inputs, in_place=True)
    assert_onnxruntimes_kernel_computed_the_reference(inputs, out, keys, values, query)


@needs_compiler
def test_an_engine_decoding_with_it_matches_transformers_alone_and_batched(engine_factory, checkpoint_factory):
    from runner import LLM, SamplingParams

    engine = engine_factory()  # the default build
    llm = LLM(str(engine), max_batch=2)
    manifest = llm.engine.manifest
    assert manifest.graphs["step"].native_library == native_ops.LIBRARY_NAME
    assert "DecodeAttention" in manifest.graphs["step"].native_ops
    assert {phase.graph for phase in manifest.phases.values()} == {
        "step"
    }  # one graph, one session: weights packed once
    reference = load_reference(checkpoint_factory("gqa"))
    prompts = [[5, 6, 7, 8, 9], [11, 3, 4]]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    for prompt, output in zip(prompts, together):
        assert output.token_ids == reference_greedy(reference, prompt, 24)
        assert llm.generate([{"prompt_token_ids": prompt}], greedy)[0].token_ids == output.token_ids


def test_where_it_cannot_be_built_the_build_says_why_and_decodes_on_the_step_graph(
    monkeypatch, checkpoint_factory, tmp_path
):
    from builder.build import BuildOptions, build_engine
    from engines.format import open_artifact

    monkeypatch.setattr(native_ops, "unavailable_reason", lambda: "no C compiler (cc) on this machine")
    lines = []
    build_engine(
        BuildOptions(
            str(checkpoint_factory("gqa")),
            tmp_path / "engine",
            max_seq_len=64,
            max_batch=2,
            prefill_chunk=16,
            native_decode_attention=True,
        ),
        log=lines.append,
    )
    manifest = open_artifact(tmp_path / "engine").manifest
    assert manifest.graphs["step"].native_library is None
    assert manifest.graphs["step"].native_ops == []
    assert any("onnxruntime's own ops (no C compiler (cc) on this machine)" in line for line in lines)
