"""The `builder` command line: the build stage's commands (builder/cli.py) plus `train-drafter`, which runs a built
engine through the runner to distil a draft head, so it lives above both packages."""

from __future__ import annotations

from pathlib import Path

import click

from builder.cli import main as build_commands
from builder.loaders import CheckpointError
from engines.cli_errors import exit_on
from engines.format import ArtifactError
from training.drafter import DrafterTrainingOptions, train_drafter


@click.command("train-drafter")
@click.argument("engine", type=click.Path(path_type=Path))
@click.option(
    "--out", "out", required=True, type=click.Path(path_type=Path), help="Draft head file to write (.safetensors)."
)
@click.option(
    "--prompts", type=int, default=1200, show_default=True, help="Shipped training prompts the target answers."
)
@click.option(
    "--validation", type=int, default=40, show_default=True, help="Validation prompts (unseen templates and topics)."
)
@click.option("--max-new-tokens", type=int, default=128, show_default=True, help="Longest target answer.")
@click.option("--draft-vocab", type=int, default=4096, show_default=True, help="Tokens the head can propose.")
@click.option("--horizon", type=int, default=4, show_default=True, help="Draft tokens trained per position.")
@click.option("--blocks", type=int, default=2, show_default=True, help="Residual blocks in the head.")
@click.option("--epochs", type=int, default=6, show_default=True, help="The best epoch on validation is kept.")
@click.option("--dropout", type=float, default=0.1, show_default=True, help="On the head's input while training.")
@click.option(
    "--distill",
    type=float,
    default=1.0,
    show_default=True,
    help="Weight of the soft loss against the target's next-token distributions (0: its greedy tokens only).",
)
@click.option(
    "--traces",
    type=click.Path(path_type=Path),
    default=None,
    help="Directory keeping the target's answers and hidden states, a file per shard of prompts: shards present are "
    "read, the rest generated and written (a stopped run resumes there).",
)
@click.option(
    "--score-engine",
    type=click.Path(path_type=Path),
    default=None,
    help="Engine of the same model whose hidden states the head learns from (e.g. fp32 for a quantized target; "
    "default: ENGINE).",
)
@click.option("--shard-size", type=int, default=256, show_default=True, help="Prompts per traces shard.")
@click.option("--threads", type=int, default=None, help="CPU threads for the target engine.")
@click.option(
    "--checkpoint", default=None, help="Where the target's embeddings are read (default: the engine's source)."
)
@click.option(
    "--bf16/--fp32",
    "bf16",
    default=None,
    help="Train in bfloat16 autocast or float32 (default: bfloat16 where the CPU has native bf16 matmuls).",
)
@click.option(
    "--device",
    default=None,
    help="Answer, score and train in PyTorch on this device (cuda, cpu) from a checkpoint: ENGINE is then "
    '"default", a .gguf file or a Hugging Face directory, run by the builder\'s model in float32.',
)
@click.option("--generate-batch", type=int, default=512, show_default=True, help="With --device: prompts per batch.")
@click.option("--batch-size", type=int, default=256, show_default=True, help="Training positions per step.")
@click.option("--learning-rate", type=float, default=2e-3, show_default=True, help="Peak of the one-cycle schedule.")
@click.option("--seed", type=int, default=0, show_default=True)
def train_drafter_command(
    engine,
    out,
    prompts,
    validation,
    max_new_tokens,
    draft_vocab,
    horizon,
    blocks,
    epochs,
    dropout,
    distill,
    traces,
    score_engine,
    shard_size,
    threads,
    checkpoint,
    bf16,
    device,
    generate_batch,
    batch_size,
    learning_rate,
    seed,
) -> None:
    """Distil a ReDrafter draft head for the target ENGINE from its own answers to the shipped prompts (or, with
    --device, for the checkpoint ENGINE from its float32 answers)."""
    with exit_on(ArtifactError, CheckpointError, ValueError):
        options = DrafterTrainingOptions(
            engine,
            out,
            prompts=prompts,
            validation=validation,
            max_new_tokens=max_new_tokens,
            draft_vocab=draft_vocab,
            horizon=horizon,
            num_blocks=blocks,
            epochs=epochs,
            dropout=dropout,
            distill=distill,
            traces=traces,
            score_engine=score_engine,
            shard_size=shard_size,
            threads=threads,
            checkpoint=checkpoint,
            bf16=bf16,
            device=device,
            generate_batch=generate_batch,
            batch_size=batch_size,
            learning_rate=learning_rate,
            seed=seed,
        )
        facts = train_drafter(options, log=lambda line: click.echo(line, err=True))
    click.echo(
        f"draft head: {out} ({out.stat().st_size / 2**20:.1f} MiB), kept epoch {facts['kept_epoch']}, "
        f"validation tokens per step: {facts['validation_tokens_per_step']}"
    )


main = click.Group(
    "builder",
    commands=[*build_commands.commands.values(), train_drafter_command],
    params=build_commands.params,
    help=build_commands.help,
)

if __name__ == "__main__":
    main()
