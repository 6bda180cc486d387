"""A tensor-parallel engine against the single-rank engine of the same weights, interleaved round by round
(benchmarks/interleave.py): TP=1 with 1 and with 2 threads, TP=N with 1 thread per rank.

    builder build default --quant none --out /tmp/e/tp1 && builder build default --quant none --tp 2 --out /tmp/e/tp2
    python benchmarks/tensor_parallel.py /tmp/e/tp1 /tmp/e/tp2 --runs 5 --out benchmarks/results/tp_....json

Each side is its own worker process (the TP one starts its other ranks), timing greedy generation of --new-tokens
tokens (EOS held off) after the short and the long chat prompt at batch 1. Prints medians and ratios paired by round,
and for the TP engine the share of rank 0's generation time spent in the collectives (AllReduce, AllGather), and
how much of that was waiting for the other ranks. It warns where the sides' greedy tokens differ (an engine with int8
activations can flip a near tie: docs/tensor-parallel.md).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import click

SIDES = {"tp1_1thread": ("single", 1), "tp1_2threads": ("single", 2), "tpN_1thread": ("sharded", 1)}


def worker(engine: str, threads: int, prompts_file: str, new_tokens: int) -> None:
    from benchmarks.interleave import decode_rate, serve
    from runner import LLM, SamplingParams

    llm = LLM(engine, threads=threads, max_batch=1)
    ranks = llm.engine.ranks
    spent = {"generation_s": 0.0, "collective_s": 0.0, "waiting_s": 0.0, "ranks": 1 if ranks is None else ranks.ranks}

    def generate(ids: list[int], count: int) -> tuple[float, float, list[int]]:
        before = ranks.segment.times() if ranks else (0.0, 0.0)
        params = SamplingParams(max_tokens=count, min_tokens=count, temperature=0.0)
        start = time.perf_counter()
        request = llm.engine.add_request(None, ids, params)
        first = None
        while not request.finished:
            llm.engine.step()
            if first is None and request.output_token_ids:
                first = time.perf_counter()
        end = time.perf_counter()
        after = ranks.segment.times() if ranks else (0.0, 0.0)
        spent["generation_s"] += end - start
        spent["collective_s"] += after[0] - before[0]
        spent["waiting_s"] += after[1] - before[1]
        tokens = list(request.output_token_ids)
        return first - start, decode_rate(len(tokens), end - first), tokens

    serve(generate, spent, json.loads(Path(prompts_file).read_text()), new_tokens)


@click.command()
@click.argument("single_rank_engine")
@click.argument("sharded_engine")
@click.option("--runs", default=5, show_default=True, help="Rounds; each times every prompt on every side.")
@click.option("--new-tokens", default=128, show_default=True)
@click.option("--long-prompt-tokens", default=650, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Also write the results as JSON.")
def main(single_rank_engine, sharded_engine, runs, new_tokens, long_prompt_tokens, out) -> None:
    from benchmarks.interleave import interleaved_runs, paired_ratio
    from benchmarks.provenance import source_commit
    from runner import LLM
    from runner.core.machine import cpu_model, memory_bandwidth_gbs
    from runner.tools.bench import chat_prompts

    machine = f"{cpu_model()}, memory bandwidth (triad, 2 threads) {memory_bandwidth_gbs(2):.1f} GB/s"
    engines = {"single": single_rank_engine, "sharded": sharded_engine}
    prompts = chat_prompts(LLM(single_rank_engine, verify_checksums=False).tokenizer, long_prompt_tokens)
    prompts_file = Path(tempfile.mkstemp(suffix=".json")[1])
    prompts_file.write_text(json.dumps(prompts))
    here = str(Path(__file__).resolve().parent.parent)
    workers = {
        side: [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {here!r}); from benchmarks.tensor_parallel import worker; "
            f"worker({engines[engine]!r}, {threads}, {str(prompts_file)!r}, {new_tokens})",
        ]
        for side, (engine, threads) in SIDES.items()
    }
    try:
        results = interleaved_runs(workers, prompts, runs, threads=1, log=lambda line: click.echo(line, err=True))
    finally:
        prompts_file.unlink(missing_ok=True)
    same_tokens = {}
    for name in prompts:
        answers = {side: results[side][name]["first_tokens"] for side in SIDES}
        same_tokens[name] = len({json.dumps(tokens) for tokens in answers.values()}) == 1
        if not same_tokens[name]:  # int8 activations: summing the ranks' parts in another order can flip a near tie
            click.echo(f"warning: the sides answer the {name} prompt differently: {answers}", err=True)
    sharded = results["tpN_1thread"]
    ranks = sharded["ranks"]
    click.echo(f"{machine}; {runs} interleaved rounds, {new_tokens} new tokens, TP={ranks}")
    summary = {}
    for name in prompts:
        row = {side: results[side][name] for side in SIDES}
        ratios = {
            f"tp{ranks}_over_{side}": {
                "decode": paired_ratio(row["tpN_1thread"]["decode_tok_s_runs"], row[side]["decode_tok_s_runs"]),
                "ttft": paired_ratio(row[side]["ttft_ms_runs"], row["tpN_1thread"]["ttft_ms_runs"]),
            }
            for side in ("tp1_1thread", "tp1_2threads")
        }
        summary[name] = ratios
        click.echo(
            f"{name:5} ({row['tp1_1thread']['prompt_tokens']} tokens): decode tok/s "
            + ", ".join(f"{side} {row[side]['decode_tok_s']:.1f}" for side in SIDES)
            + "; TTFT ms "
            + ", ".join(f"{side} {row[side]['ttft_ms']:.0f}" for side in SIDES)
        )
        for label, ratio in ratios.items():
            click.echo(
                f"      {label}: decode {ratio['decode'][0]:.2f}x ({ratio['decode'][1]:.2f}-{ratio['decode'][2]:.2f}), "
                f"TTFT {ratio['ttft'][0]:.2f}x (> 1: TP faster)"
            )
    share = sharded["collective_s"] / sharded["generation_s"]
    waiting = sharded["waiting_s"] / sharded["generation_s"]
    click.echo(f"rank 0 spent {share:.1%} of its generation time in collectives, {waiting:.1%} of it waiting for ranks")
    click.echo(
        "peak RSS (rank 0 / the process): " + ", ".join(f"{s} {results[s]['peak_rss_mb']:.0f} MiB" for s in SIDES)
    )
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        record = {"machine": machine, "commit": source_commit(), "runs": runs, "new_tokens": new_tokens}
        record |= {"same_tokens": same_tokens}
        record |= {"summary": summary, **results}
        out.write_text(json.dumps({**record, "collective_share": share, "waiting_share": waiting}, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
