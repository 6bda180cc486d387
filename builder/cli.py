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
def build(checkpoint: str, out: Path, dtype: str, max_seq_len: int | None, max_batch: int, prefill_chunk: int, overwrite: bool) -> None:
    """Build an engine from CHECKPOINT: a Hugging Face directory, a .gguf file, or `default`."""
    options = BuildOptions(checkpoint, out, dtype, max_seq_len, max_batch, prefill_chunk, overwrite)
    try:
        report = build_engine(options, log=lambda line: click.echo(line, err=True))
    except (CheckpointError, FileExistsError, ValueError) as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2)
    for line in report.lines():
        click.echo(line)
