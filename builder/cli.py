"""`builder build ...`"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from builder.build import DTYPES, BuildOptions, build_engine
from builder.loaders import CheckpointError


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
@click.option("--prefill-chunk", type=int, default=128, show_default=True, help="Tokens per prefill chunk.")
@click.option("--overwrite", is_flag=True, help="Replace an existing engine at --out.")
@click.option("--quant", type=click.Choice(["none", "int8", "int4"]), default="none", show_default=True,
              help="Weight-only quantization of every linear (round to nearest, symmetric, per group).")
@click.option("--group-size", type=click.Choice(["16", "32", "64", "128", "256"]), default=None,
              help="Input features per quantization group (default: 32 for int4, 128 for int8).")
@click.option("--quant-lm-head/--float-lm-head", default=True, show_default=True, help="Quantize the LM head too.")
@click.option("--int8-compute/--fp32-compute", default=True, show_default=True,
              help="Quantized matmuls quantize activations to int8 (onnxruntime accuracy_level 4: much faster on CPU; "
                   "onnxruntime's fp32-compute path for 8-bit weights is a slow fallback).")
def build(checkpoint, out, dtype, max_seq_len, max_batch, prefill_chunk, overwrite, quant, group_size, quant_lm_head, int8_compute) -> None:
    """Build an engine from CHECKPOINT: a Hugging Face directory, a .gguf file, or `default`."""
    options = BuildOptions(
        checkpoint, out, dtype, max_seq_len, max_batch, prefill_chunk, overwrite, quant,
        int(group_size) if group_size else None, quant_lm_head, int8_compute,
    )
    try:
        report = build_engine(options, log=lambda line: click.echo(line, err=True))
    except (CheckpointError, FileExistsError, ValueError) as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2)
    for line in report.lines():
        click.echo(line)
