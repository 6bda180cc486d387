"""The plain engine next to one or more speculative engines of the same model, side by side in one process, batch 1,
greedy.

    python benchmarks/speculative.py --plain engines-out/default --speculative engines-out/default-redrafter \
        [--speculative engines-out/another-speculative-engine ...]

Chat prompts here use templates and topics the shipped draft head never saw (builder/speculation/drafter_prompts.py),
plus one long summarisation prompt (~650 tokens, reported apart: prompt lookup's case). Each prompt runs on every engine
in turn (a warm-up first, then --runs rounds of plain, speculative 1, speculative 2, ..., each round and batched group
starting one engine later: run first in every group, the plain engine read ~10% faster than the same speculative
engine with verification off on a Zen 4 VM, within 3% with the order alternated): this VM's memory bandwidth
drifts within minutes and moves the memory-bound plain engine most, so only engines timed in the same rounds compare.
Answers end at EOS or --new-tokens; decode speed is tokens after the first over the time after the first token, and
the whole answers' speed-up is over their time from submission (a draft model's pass over the prompt runs after the
first token, in the decode time); the overall figures are over the chat prompts. Prints per-prompt and overall
numbers, checks that every output is the plain engine's, and writes benchmarks/results/speculative.json.
`--json-schema SCHEMA` (JSON, or a file holding it) holds every answer to that schema (structured outputs: the drafts
are cut where the grammar stops allowing them and verified with each tree node's own mask).
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.interleave import rotated  # noqa: E402
from benchmarks.provenance import source_commit  # noqa: E402

HELD_OUT_PROMPTS = [
    "What is the capital of France?",
    "Describe how a rainbow forms.",
    "Write a haiku about autumn leaves.",
    "How do I make a good cup of tea?",
    "What are some fun things to do on a rainy day?",
    "Explain why the sky is blue.",
    "Give me a recipe for a simple vegetable soup.",
    "What is the difference between weather and climate?",
    "Tell me about the life of honeybees in winter.",
    "How can I become a better listener?",
]


def _estimate_line(estimate: dict) -> str:
    """A speculation policy's averages for one row count, as the benchmark prints them."""

    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{1000 * seconds:.1f} ms"

    tokens = estimate["tokens_per_verify"]
    return (
        f"plain {ms(estimate['plain_seconds'])}, verify {ms(estimate['verify_seconds'])} "
        f"(trees of {estimate['tree_nodes'] or 'any'} nodes, "
        f"{'-' if tokens is None else f'{tokens:.2f}'} tokens per row and verify step)"
    )


def timed(engine, prompt_ids: list[int], new_tokens: int, schema: dict | None) -> tuple[list[int], float, float]:
    from runner.sampling.params import SamplingParams
    from runner.sampling.structured import StructuredOutputs

    structured = None if schema is None else StructuredOutputs(json=schema)
    request = engine.add_request(
        None, prompt_ids, SamplingParams(max_tokens=new_tokens, temperature=0.0, structured_outputs=structured)
    )
    start = time.perf_counter()
    first = None
    while not request.finished:
        engine.step()
        if first is None and request.output_token_ids:
            first = time.perf_counter()
    return list(request.output_token_ids), (first - start) * 1000, time.perf_counter() - first


def batched(engine, prompts_ids: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
    """All prompts submitted at once and generated together: (their tokens, seconds until the last finished)."""
    from runner.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    requests = [engine.add_request(None, ids, params) for ids in prompts_ids]
    start = time.perf_counter()
    while not all(r.finished for r in requests):
        engine.step()
    return [list(r.output_token_ids) for r in requests], time.perf_counter() - start


@click.command()
@click.option("--plain", "plain_dir", required=True, type=click.Path(exists=True))
@click.option(
    "--speculative",
    "spec_dirs",
    required=True,
    multiple=True,
    help="A speculative engine; DIR@N opens it with draft trees of at most N nodes (0: its whole trees; "
    "without @: the runner's default for this CPU). The same engine may come more than once.",
)
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--new-tokens", type=int, default=128, show_default=True)
@click.option("--runs", type=int, default=2, show_default=True, help="Timed rounds per prompt (median per engine).")
@click.option(
    "--out", type=click.Path(), default=str(ROOT / "benchmarks" / "results" / "speculative.json"), show_default=True
)
@click.option(
    "--json-schema", "json_schema", default=None, help="Hold every answer to this JSON schema (JSON or a file)."
)
@click.option(
    "--batches",
    default="",
    help="Also run the chat prompts this many at a time (comma-separated sizes, e.g. 2,4): tokens per second summed "
    "over the rows, from submission to the last answer, each speculative engine as it decides per step.",
)
def main(plain_dir, spec_dirs, threads, new_tokens, runs, out, json_schema, batches) -> None:
    from runner.core.args import EngineArgs
    from runner.core.engine import LLMEngine
    from runner.core.machine import cpu_model
    from runner.tools.bench import chat_prompts

    schema = None
    if json_schema is not None:
        schema = json.loads(Path(json_schema).read_text() if Path(json_schema).is_file() else json_schema)

    plain = LLMEngine(EngineArgs(plain_dir, threads=threads))
    specs = {}
    for spec in spec_dirs:
        spec_dir, limit = spec.rsplit("@", 1) if "@" in spec else (spec, None)
        if not Path(spec_dir).is_dir():
            raise click.UsageError(f"no engine directory {spec_dir}")
        specs[spec] = LLMEngine(
            EngineArgs(spec_dir, threads=threads, max_verify_nodes="auto" if limit is None else int(limit) or None)
        )
        if specs[spec].speculation is None:
            raise click.UsageError(f"{spec_dir} is not a speculative engine")
    engines = {"plain": plain, **specs}

    def compare(kind: str, label: str, ids: list[int]) -> dict:
        for engine in engines.values():
            timed(engine, ids, 8, schema)  # warm-up (and xgrammar's import, once)
        results = {name: [] for name in engines}
        before = {
            name: (spec.speculation_stats.verify_steps, spec.speculation_stats.emitted_tokens)
            for name, spec in specs.items()
        }
        for round_ in range(runs):
            for name, engine in rotated(list(engines.items()), round_):
                results[name].append(timed(engine, ids, new_tokens, schema))
        tokens = {name: r[0][0] for name, r in results.items()}
        row = {
            "kind": kind,
            "prompt": label,
            "prompt_tokens": len(ids),
            "new_tokens": len(tokens["plain"]),
            "engines": {},
        }
        for name, r in results.items():
            decode_s = statistics.median(x[2] for x in r)
            row["engines"][name] = {
                "decode_s": decode_s,
                "decode_tok_s": (len(r[0][0]) - 1) / decode_s,
                "ttft_ms": statistics.median(x[1] for x in r),
                "answer_s": statistics.median(x[1] / 1000 + x[2] for x in r),  # submission to the last token
                "identical": tokens[name] == tokens["plain"],
            }
        line = (
            f"{label[:44]:<46} {row['new_tokens']:>4} tok  plain {row['engines']['plain']['decode_tok_s']:6.1f} tok/s"
        )
        for name, spec in specs.items():
            steps = spec.speculation_stats.verify_steps - before[name][0]
            emitted = spec.speculation_stats.emitted_tokens - before[name][1]
            stats = row["engines"][name]
            stats["tokens_per_verify_step"] = emitted / steps if steps else 0.0
            line += (
                f" | {Path(name).name} {stats['decode_tok_s']:6.1f} tok/s "
                f"x{stats['decode_tok_s'] / row['engines']['plain']['decode_tok_s']:.2f} "
                f"{stats['tokens_per_verify_step']:.2f} tok/step {'identical' if stats['identical'] else 'DIFFERENT'}"
            )
        print(line)
        return row

    chat_ids = [
        plain.codec.encode(plain.codec.apply_chat_template([{"role": "user", "content": question}]))
        for question in HELD_OUT_PROMPTS
    ]
    rows = [compare("chat", question, ids) for question, ids in zip(HELD_OUT_PROMPTS, chat_ids)]
    chat_stats = {name: copy.deepcopy(spec.speculation_stats) for name, spec in specs.items()}
    rows.append(compare("summary", "Summarise this text: <CPython licence>", chat_prompts(plain.codec)["long"]))
    chat_rows = [r for r in rows if r["kind"] == "chat"]
    chat_tokens = sum(r["new_tokens"] - 1 for r in chat_rows)
    rate = {name: chat_tokens / sum(r["engines"][name]["decode_s"] for r in chat_rows) for name in engines}
    answer_s = {name: sum(r["engines"][name]["answer_s"] for r in chat_rows) for name in engines}
    print(f"chat prompts overall: plain {rate['plain']:.1f} tok/s")
    summaries = {}
    for name, stats in chat_stats.items():
        identical = all(r["engines"][name]["identical"] for r in rows)
        summaries[name] = {
            "speculation": specs[name].speculation.facts(),
            "max_verify_nodes": specs[name].max_verify_nodes,
            "decode_tok_s": rate[name],
            "speed_up": rate[name] / rate["plain"],
            # the whole answers' time, first token included (a draft model's pass over the prompt falls after it)
            "end_to_end_speed_up": answer_s["plain"] / answer_s[name],
            "tokens_per_verify_step": stats.mean_accepted,
            "accepted_drafts_histogram": stats.accepted_histogram,
            "draft_seconds_per_step_ms": 1000 * stats.draft_seconds / max(stats.verify_steps, 1),
            "verify_seconds_per_step_ms": 1000 * stats.verify_seconds / max(stats.verify_steps, 1),
            "all_identical": identical,
        }
        summary = summaries[name]
        print(
            f"  {name}: {rate[name]:.1f} tok/s, speed-up x{summary['speed_up']:.2f} "
            f"(whole answers x{summary['end_to_end_speed_up']:.2f}), {stats.mean_accepted:.2f} tokens "
            "per verify "
            f"step, draft {summary['draft_seconds_per_step_ms']:.1f} ms + verify "
            f"{summary['verify_seconds_per_step_ms']:.1f} ms "
            f"per step, outputs {'identical' if identical else 'DIFFERENT'}"
        )
    batched_rows = {}
    for batch in [int(b) for b in batches.split(",") if b]:
        groups = [(chat_ids * 2)[i : i + batch] for i in range(0, len(chat_ids), batch)]
        for engine in engines.values():
            batched(engine, groups[0], 8)  # warm-up of this batch's buckets
        seconds = {name: [] for name in engines}
        outputs = {}
        before = {name: (e.speculation_stats.verify_steps, e.speculation_stats.plain_rows) for name, e in specs.items()}
        for round_ in range(runs):
            for index, group in enumerate(groups):  # engines alternate group by group: a slow spell hits them alike
                for name, engine in rotated(list(engines.items()), round_ * len(groups) + index):
                    tokens, elapsed = batched(engine, group, new_tokens)
                    outputs.setdefault(name, []).append(tokens)
                    seconds[name].append(elapsed)
        total = sum(len(t) for group in outputs["plain"][: len(groups)] for t in group)
        rates = {name: runs * total / sum(s) for name, s in seconds.items()}
        batched_rows[batch] = {
            name: {
                "tok_s": rates[name],
                "speed_up": rates[name] / rates["plain"],
                "identical": outputs[name] == outputs["plain"],
                **(
                    {}
                    if name == "plain"
                    else {
                        "verify_row_steps": specs[name].speculation_stats.verify_steps - before[name][0],
                        "plain_row_steps": specs[name].speculation_stats.plain_rows - before[name][1],
                        "cost_model": specs[name].speculation_policy.estimates(),
                    }
                ),
            }
            for name in engines
        }
        print(
            f"batch {batch}: plain {rates['plain']:.1f} tok/s"
            + "".join(
                f" | {Path(name).name} {r['tok_s']:.1f} tok/s x{r['speed_up']:.2f} "
                f"({r['verify_row_steps']} row-steps verified, {r['plain_row_steps']} plain) "
                f"{'identical' if r['identical'] else 'DIFFERENT'}"
                for name, r in batched_rows[batch].items()
                if name != "plain"
            )
        )
        for name, r in batched_rows[batch].items():
            for rows_count, estimate in r.get("cost_model", {}).items():
                print(f"  {Path(name).name} cost model at {rows_count} rows: {_estimate_line(estimate)}")
    commit = source_commit()
    record = {
        "commit": commit,
        "machine": {"cpu": cpu_model(), "threads": threads},
        "plain": plain_dir,
        "plain_decode_tok_s": rate["plain"],
        "speculative": summaries,
        "new_tokens": new_tokens,
        "runs": runs,
        "json_schema": schema,
        "prompts": rows,
        "batched": batched_rows,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(record, indent=2))
    if not all(s["all_identical"] for s in summaries.values()) or not all(
        r["identical"] for by_engine in batched_rows.values() for r in by_engine.values()
    ):
        raise SystemExit("a speculative engine's output differs from the plain engine's")


if __name__ == "__main__":
    main()
