"""`builder build ...`: the build stage's command line. `builder train-drafter`, which needs the runner too, is added
to it by training/cli.py, the console script's entry point."""

from __future__ import annotations

from pathlib import Path

import click

from builder.build import DEFAULT_DRAFT_LEN, DTYPES, KV_CACHE_DTYPES, BuildOptions, build_engine
from builder.loaders import CheckpointError
from builder.quantization.gptq import GPTQOptions
from engines.cli_errors import exit_on
from engines.format import BACKENDS


@click.group()
@click.version_option(package_name="llm-engine-builder")
def main() -> None:
    """Build ahead-of-time compiled LLM engines."""


@main.command()
@click.argument("checkpoint")
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="Engine directory to write.")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="fp32", show_default=True)
@click.option("--max-seq-len", type=int, default=None, help="Longest prompt + output (default: min(2048, model's)).")
@click.option("--max-batch", type=int, default=8, show_default=True, help="Largest decode batch bucket.")
@click.option(
    "--prefill-chunk",
    type=int,
    default=None,
    help="The largest prompt chunk one graph call computes (default: min(1024, --max-seq-len); 128 with an int8 KV "
    "cache); the runner cuts smaller chunks while other requests generate (runner serve --shared-prefill-chunk).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing engine at --out.")
@click.option(
    "--quant",
    type=click.Choice(["auto", "none", "int8", "int4", "gptq"]),
    default="auto",
    show_default=True,
    help="Weight-only quantization of every linear: auto = the checkpoint's own (a GGUF's Q4_0/Q4_1/Q8_0 blocks "
    "kept exactly, other quantized types requantized to int4 or int8 in groups of 32; a Hugging Face checkpoint "
    "stays float); int8/int4 round to nearest (symmetric, per group); gptq = int4 chosen by GPTQ on calibration "
    "text.",
)
@click.option(
    "--group-size",
    type=click.Choice(["16", "32", "64", "128", "256"]),
    default=None,
    help="Input features per quantization group (default: 32 for int4, 128 for int8).",
)
@click.option("--quant-lm-head/--float-lm-head", default=True, show_default=True, help="Quantize the LM head too.")
@click.option(
    "--quant-embedding/--float-embedding",
    default=True,
    show_default=True,
    help="Store the token embedding table in blocks too (a GGUF's own where they fit; a tied model reads its "
    "quantized LM head's); a lookup dequantizes only its tokens' rows.",
)
@click.option(
    "--int8-compute/--fp32-compute",
    default=True,
    show_default=True,
    help="Quantized matmuls quantize activations to int8 (onnxruntime accuracy_level 4: much faster on CPU; "
    "onnxruntime's fp32-compute path for 8-bit weights is a slow fallback).",
)
@click.option(
    "--gptq-damping", type=float, default=0.1, show_default=True, help="GPTQ: fraction of mean(diag H) added to H."
)
@click.option(
    "--gptq-act-order/--gptq-column-order",
    default=True,
    show_default=True,
    help="GPTQ: quantize the most-used input features first.",
)
@click.option("--gptq-samples", type=int, default=48, show_default=True, help="GPTQ: calibration sequences.")
@click.option(
    "--gptq-sample-len", type=int, default=256, show_default=True, help="GPTQ: tokens per calibration sequence."
)
@click.option(
    "--calibration-text",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    multiple=True,
    help="GPTQ: calibration text, repeatable "
    "(default: the builder's own, see builder/quantization/calibration/README.md).",
)
@click.option(
    "--keep-gguf-blocks/--requantize-gguf",
    default=True,
    show_default=True,
    help="GGUF Q4_0/Q4_1/Q8_0 weights whose blocks map exactly onto --quant with groups of 32 are taken as "
    "they are (no float round trip); the build summary says which.",
)
@click.option(
    "--speculative",
    type=click.Choice(["none", "redrafter", "prompt-lookup", "draft-model"]),
    default="none",
    show_default=True,
    help="Speculative decoding: redrafter = a recurrent draft head with beam search in a draft graph; "
    "prompt-lookup = drafts copied from the request's own context after a matching n-gram; "
    "draft-model = a smaller model of the same vocabulary drafts greedily (--draft-model).",
)
@click.option(
    "--draft-model",
    default=None,
    help="draft-model: its checkpoint (a Hugging Face directory, a .gguf file, or `default`).",
)
@click.option(
    "--draft-head",
    type=click.Path(path_type=Path),
    default=None,
    help="Draft head from `builder train-drafter` (default for `default`: the head shipped with the builder).",
)
@click.option("--beam-width", type=int, default=2, show_default=True, help="Draft beams per step (redrafter).")
@click.option(
    "--draft-len",
    type=int,
    default=None,
    help="Draft tokens per beam  [default: "
    + ", ".join(f"{n} for {method}" for method, n in DEFAULT_DRAFT_LEN.items())
    + "].",
)
@click.option(
    "--draft-quant",
    type=click.Choice(["int8", "int4", "none"]),
    default=None,
    help="The draft's matmuls, fused with int8 compute (drafts only propose, so output is unchanged): the ReDrafter "
    "head's linears (default int4) or the draft model's engine (default int8).",
)
@click.option(
    "--kv-cache-dtype",
    type=click.Choice(KV_CACHE_DTYPES),
    default="auto",
    show_default=True,
    help="auto = the model's dtype (exact); int8 = a quarter of float32's bytes per cached position, with "
    "static per-channel scales calibrated on the builder's text (lossy: see docs/quantization.md).",
)
@click.option(
    "--prompt-lookup-len",
    type=int,
    default=4,
    show_default=True,
    help="redrafter: also draft this many tokens by prompt lookup, as one more beam of the tree (0 = off).",
)
@click.option(
    "--min-draft-prob",
    type=float,
    default=0.1,
    show_default=True,
    help="redrafter: verify only draft tokens whose beam prefix the head gives at least this probability (0 = all).",
)
@click.option(
    "--native-decode-attention/--onnxruntime-decode-attention",
    default=True,
    show_default=True,
    help="Decode steps run our DecodeAttention CPU kernel, compiled here with cc, instead of onnxruntime's "
    "GroupQueryAttention (fp32 engines on Linux x86-64, float or int8 KV cache; the build says when it cannot).",
)
@click.option(
    "--native-quantized-matmul/--onnxruntime-quantized-matmul",
    default=True,
    show_default=True,
    help="int4 / int8 weights with int8 activations run our Int4MatMul / Int8MatMul CPU kernels (batch-invariant; "
    "AVX2 + FMA), compiled here with cc, instead of onnxruntime's MatMulNBits.",
)
@click.option(
    "--backend",
    type=click.Choice(list(BACKENDS)),
    default="onnxruntime",
    show_default=True,
    help="onnxruntime: ONNX graphs (CPU, or CUDA with onnxruntime-gpu); aoti: the step graph compiled by "
    "AOTInductor (needs torch where it runs); tensorrt: a TensorRT engine from the step graph's ONNX.",
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="aoti: the device the package is compiled for (cuda: on this machine's GPU, int4 through a Triton kernel).",
)
@click.option(
    "--tp",
    "tensor_parallel",
    type=int,
    default=1,
    show_default=True,
    help="Tensor-parallel ranks: one step graph per rank, each with its share of the heads, MLP and vocabulary; "
    "the runner starts the ranks itself.",
)
def build(
    checkpoint,
    out,
    dtype,
    max_seq_len,
    max_batch,
    prefill_chunk,
    overwrite,
    quant,
    group_size,
    quant_lm_head,
    quant_embedding,
    int8_compute,
    gptq_damping,
    gptq_act_order,
    gptq_samples,
    gptq_sample_len,
    calibration_text,
    keep_gguf_blocks,
    speculative,
    draft_model,
    draft_head,
    beam_width,
    draft_len,
    draft_quant,
    kv_cache_dtype,
    prompt_lookup_len,
    min_draft_prob,
    native_decode_attention,
    native_quantized_matmul,
    backend,
    device,
    tensor_parallel,
) -> None:
    """Build an engine from CHECKPOINT: a Hugging Face directory, a .gguf file, or `default`."""
    with exit_on(ValueError):
        gptq = GPTQOptions(
            gptq_damping,
            gptq_act_order,
            gptq_samples,
            gptq_sample_len,
            tuple(calibration_text) or GPTQOptions.calibration,
        )
    options = BuildOptions(
        source=checkpoint,
        out=out,
        dtype=dtype,
        max_seq_len=max_seq_len,
        max_batch=max_batch,
        prefill_chunk=prefill_chunk,
        overwrite=overwrite,
        quant=quant,
        group_size=int(group_size) if group_size else None,
        quantize_lm_head=quant_lm_head,
        quantize_embedding=quant_embedding,
        int8_compute=int8_compute,
        keep_source_blocks=keep_gguf_blocks,
        gptq=gptq,
        speculative=speculative,
        draft_head=draft_head,
        beam_width=beam_width,
        draft_len=draft_len,
        draft_quant=draft_quant,
        prompt_lookup_len=prompt_lookup_len,
        min_draft_prob=min_draft_prob,
        draft_model=draft_model,
        kv_cache_dtype=kv_cache_dtype,
        native_decode_attention=native_decode_attention,
        native_quantized_matmul=native_quantized_matmul,
        backend=backend,
        device=device,
        tensor_parallel=tensor_parallel,
    )
    with exit_on(CheckpointError, FileExistsError, ValueError):
        report = build_engine(options, log=lambda line: click.echo(line, err=True))
    for line in report.lines():
        click.echo(line)


if __name__ == "__main__":
    main()
