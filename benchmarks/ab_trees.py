"""Two checkouts of this project's runner side by side: each serves its own engine from its own worker process, with
the runs interleaved round by round (benchmarks/interleave.py), so a change to the runner's code (a refactor, a new
step loop) can be compared against the commit before it on a machine whose speed drifts.

    git worktree add /tmp/before <commit>
    (cd /tmp/before && python -c "from builder.cli import main; main()" build default --quant int4 \
        --requantize-gguf --out /tmp/engines/before)
    builder build default --quant int4 --requantize-gguf --out /tmp/engines/after
    python benchmarks/ab_trees.py --before /tmp/before /tmp/engines/before --after . /tmp/engines/after --runs 8

Each worker runs with the checkout's directory first on its module path and opens its engine through the Python API
both sides have (`LLM(engine, threads=..., max_batch=1)`, one stream as `runner generate` runs it), timing greedy
generation of --new-tokens tokens (EOS held off) after the short and the long chat prompt. Prints the medians of each
side and the ratios paired round by round (median and range; > 1: the after side is faster). Both sides must produce
the same greedy tokens (the engines hold the same weights), or the comparison is refused.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import click


def worker(engine: str, threads: int, prompts_file: str, new_tokens: int) -> None:
    """Runs inside the checkout under test: only the API every version has."""
    from benchmarks.interleave import decode_rate, serve
    from runner import LLM, SamplingParams

    llm = LLM(engine, threads=threads, max_batch=1)

    def generate(ids: list[int], count: int) -> tuple[float, float, list[int]]:
        engine_ = llm.engine
        params = SamplingParams(max_tokens=count, min_tokens=count, temperature=0.0)
        start = time.perf_counter()
        request = engine_.add_request(None, ids, params)
        first = None
        while not request.finished:
            engine_.step()
            if first is None and request.output_token_ids:
                first = time.perf_counter()
        tokens = list(request.output_token_ids)
        return first - start, decode_rate(len(tokens), time.perf_counter() - first), tokens

    prompts = json.loads(Path(prompts_file).read_text())
    serve(generate, {"engine": engine}, prompts, new_tokens)


@click.command()
@click.option("--before", nargs=2, required=True, help="CHECKOUT ENGINE: the reference side.")
@click.option("--after", nargs=2, required=True, help="CHECKOUT ENGINE: the side under test.")
@click.option("--runs", default=8, show_default=True, help="Rounds; each times every prompt on both sides.")
@click.option("--threads", default=2, show_default=True)
@click.option("--new-tokens", default=128, show_default=True)
@click.option("--long-prompt-tokens", default=650, show_default=True, help="0: the short chat prompt alone.")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Also write the results as JSON.")
def main(before, after, runs, threads, new_tokens, long_prompt_tokens, out) -> None:
    from benchmarks.interleave import interleaved_runs, paired_ratio
    from engines.format import ArtifactError
    from runner import LLM
    from runner.core.machine import cpu_model
    from runner.tools.bench import chat_prompts

    try:  # the prompts as this checkout's runner tokenizes them, from whichever engine it can open
        prompts = chat_prompts(LLM(after[1], verify_checksums=False).tokenizer, long_prompt_tokens)
    except ArtifactError:
        prompts = chat_prompts(LLM(before[1], verify_checksums=False).tokenizer, long_prompt_tokens)
    prompts_file = Path(tempfile.mkstemp(suffix=".json")[1])
    prompts_file.write_text(json.dumps(prompts))
    workers = {}
    for label, (checkout, engine) in (("before", before), ("after", after)):
        # the checkout first on the module path; this file loaded by its path, so the checkout needs none of it
        code = (
            f"import sys, importlib.util; sys.path[:0] = [{str(Path(checkout).resolve())!r}]; "
            f"spec = importlib.util.spec_from_file_location('ab_trees', {str(Path(__file__).resolve())!r}); "
            "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
            f"module.worker({str(engine)!r}, {threads}, {str(prompts_file)!r}, {new_tokens})"
        )
        workers[label] = [sys.executable, "-c", code]
    try:
        results = interleaved_runs(workers, prompts, runs, threads, log=lambda line: click.echo(line, err=True))
    finally:
        prompts_file.unlink(missing_ok=True)
    for name in prompts:
        if results["before"][name]["first_tokens"] != results["after"][name]["first_tokens"]:
            raise SystemExit(f"the two sides answer the {name} prompt differently: not the same engine weights")
    click.echo(f"{cpu_model()}, {threads} threads, {runs} interleaved rounds, {new_tokens} new tokens")
    for name in prompts:
        b, a = results["before"][name], results["after"][name]
        decode = paired_ratio(a["decode_tok_s_runs"], b["decode_tok_s_runs"])
        ttft = paired_ratio(b["ttft_ms_runs"], a["ttft_ms_runs"])
        results[f"{name}_after_over_before"] = {"decode": decode, "ttft": ttft}
        click.echo(
            f"{name:5} ({a['prompt_tokens']} tokens): decode {b['decode_tok_s']:.1f} -> {a['decode_tok_s']:.1f} tok/s, "
            f"TTFT {b['ttft_ms']:.1f} -> {a['ttft_ms']:.1f} ms (medians); paired by round, > 1 where after is faster: "
            f"decode {decode[0]:.3f} ({decode[1]:.3f}-{decode[2]:.3f}), "
            f"TTFT {ttft[0]:.3f} ({ttft[1]:.3f}-{ttft[2]:.3f})"
        )
    click.echo(f"peak RSS: {results['before']['peak_rss_mb']:.0f} -> {results['after']['peak_rss_mb']:.0f} MiB")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"cpu": cpu_model(), "threads": threads, "runs": runs, **results}, indent=2))


if __name__ == "__main__":
    # run as a script: this checkout's packages (not at import: a worker puts the checkout under test first)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
