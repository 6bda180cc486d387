"""`runner generate ENGINE PROMPT ...` (and later `serve`, `bench`, `eval`)."""

from __future__ import annotations

import sys
import time

import click

from engines.format import ArtifactError
from runner.llm import LLM
from runner.llm_engine import PromptError
from runner.sampling import SamplingParams
from runner.tokenizer import ChatTemplateError


@click.group()
@click.version_option(package_name="llm-engine-builder")
def main() -> None:
    """Run engines built by `builder build`."""


@main.command()
@click.argument("engine", type=click.Path())
@click.argument("prompt")
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=-1, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--chat/--no-chat", default=False, help="Wrap the prompt as a user message in the chat template.")
@click.option("--threads", type=int, default=None, help="CPU threads (default: onnxruntime's choice).")
@click.option("--stats/--no-stats", default=True, help="Print token counts and speed to stderr.")
def generate(engine, prompt, max_tokens, temperature, top_k, top_p, seed, chat, threads, stats) -> None:
    """Generate a completion of PROMPT with ENGINE, streamed to stdout."""
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        llm = LLM(engine, threads=threads)
        if chat:
            prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        start = time.perf_counter()
        request = llm.engine.add_request(prompt, None, params)
        first = None
        for event in llm.engine.run([request]):
            first = first or time.perf_counter()
            click.echo(event.delta, nl=False)
        click.echo()
    except (ArtifactError, PromptError, ChatTemplateError, ValueError) as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2)
    if stats:
        decode_s = time.perf_counter() - first
        generated = len(request.output_token_ids)
        click.echo(
            f"[{len(request.prompt_token_ids)} prompt tokens, first token after {(first - start) * 1000:.0f} ms, "
            f"{generated} tokens, {(generated - 1) / decode_s if generated > 1 else 0:.1f} tok/s decode, "
            f"finish: {request.finish_reason}]",
            err=True,
        )
