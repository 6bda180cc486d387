"""Tokens per verify step of a speculative engine's greedy decoding, replayed offline: no timing, so no noise.

    python benchmarks/tree_replay.py engines-out/rd-int4 [--threads 2] [--new-tokens 128]

For every prompt the engine answers greedily once (its output is plain decoding's), a `score` pass gives the target's
hidden state at every position, and the draft graph drafts from each answer position as the runner would after
accepting up to it. The replay then walks the answer as the engine's greedy acceptance does: at a step whose root is
answer token j, the runner's tree (`ranked_drafts`: the prompt-lookup chain, then the head's prefixes by
probability, at most N nodes) is packed, the deepest node on the true continuation is accepted, and the next step
starts after it. Printed per node limit: tokens per verify step on the held-out chat prompts (benchmarks/
speculative.py's) and on the draft head's validation prompts (templates and topics its training never saw); and how
often the lookup chain's first d tokens and the head's prefixes (by the probability the head gives them) are what the
target says, the facts behind the ranking. A new head or tree rule can be judged here in minutes before a timed run
(`benchmarks/speculative.py`) prices the nodes.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import source_commit  # noqa: E402
from benchmarks.speculative import HELD_OUT_PROMPTS  # noqa: E402

NODE_LIMITS = (3, 4, 5, 6, None)  # None: whole trees
PROBABILITY_BINS = 10


@dataclass(frozen=True)
class Answer:
    prompt: list[int]
    tokens: list[int]  # the greedy answer
    beams: np.ndarray  # [len(tokens), W, K]: the draft graph's beams at the step whose root is tokens[j]
    scores: np.ndarray  # [len(tokens), W, K]: the head's log-probability of each beam's first k tokens
    chains: list[list[int]]  # per j: the prompt-lookup draft at that step


def answer(engine, text: str, new_tokens: int) -> Answer:
    from runner.sampling.params import SamplingParams
    from runner.speculative.drafts import PromptLookup

    codec, executor = engine.codec, engine.executor
    prompt = codec.encode(codec.apply_chat_template([{"role": "user", "content": text}]))
    request = engine.add_request(None, prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0))
    while not request.finished:
        engine.step()
    tokens = list(request.output_token_ids)
    hidden = np.concatenate([scored.hidden for scored in executor.score_chunks(prompt + tokens)])
    # the step whose root is tokens[j] drafts from the state after the token before it
    states = hidden[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    rows = max(executor.verify_phase.batch_sizes)
    drafted = [executor.draft(states[at : at + rows], tokens[at : at + rows]) for at in range(0, len(tokens), rows)]
    spec = engine.speculation
    lookup = PromptLookup(spec.max_ngram, spec.min_ngram)
    chains = [lookup.draft(prompt + tokens[: j + 1], spec.prompt_lookup_len) for j in range(len(tokens))]
    return Answer(prompt, tokens, *(np.concatenate(parts) for parts in zip(*drafted)), chains)


def tokens_per_step(spec, answers: list[Answer], max_nodes: int | None) -> float:
    """The engine's greedy walk over each answer with trees of at most `max_nodes` nodes."""
    from runner.speculative.drafts import pack_tree, ranked_drafts

    steps = emitted = 0
    for a in answers:
        j = 0
        while j < len(a.tokens) - 1:
            drafts = ranked_drafts(a.chains[j], a.beams[j], a.scores[j], spec.min_draft_prob, max_nodes)
            tree = pack_tree(a.tokens[j], drafts, max_depth=len(a.tokens) - 1 - j)
            node = accepted = 0
            while j + accepted + 1 < len(a.tokens):
                follow = a.tokens[j + accepted + 1]
                child = next(
                    (c for c, p in enumerate(tree.parents) if p == node and tree.tokens[c] == follow),
                    None,
                )
                if child is None:
                    break
                node, accepted = child, accepted + 1
            steps += 1
            emitted += accepted + 1
            j += accepted + 1
    return emitted / steps


def draft_accuracy(spec, answers: list[Answer]) -> dict:
    """How often the lookup chain's first d tokens, and the head's prefixes per bin of the probability the head gives
    them, equal the target's continuation."""
    depth = spec.prompt_lookup_len
    chain_hits, chain_seen = np.zeros(depth), np.zeros(depth)
    head_hits, head_seen = np.zeros(PROBABILITY_BINS), np.zeros(PROBABILITY_BINS)
    for a in answers:
        for j in range(len(a.tokens) - 1):
            truth, chain = a.tokens[j + 1 :], a.chains[j]
            for d in range(1, min(len(chain), len(truth)) + 1):
                chain_seen[d - 1] += 1
                chain_hits[d - 1] += chain[:d] == truth[:d]
            for beam, k in np.ndindex(*a.beams.shape[1:]):
                if k < len(truth):
                    bin_ = min(int(np.exp(a.scores[j, beam, k]) * PROBABILITY_BINS), PROBABILITY_BINS - 1)
                    head_seen[bin_] += 1
                    head_hits[bin_] += a.beams[j, beam, : k + 1].tolist() == truth[: k + 1]
    return {
        "lookup_by_depth": (chain_hits / np.maximum(chain_seen, 1)).round(3).tolist(),
        "lookup_positions_by_depth": chain_seen.astype(int).tolist(),
        "head_by_probability_decile": (head_hits / np.maximum(head_seen, 1)).round(3).tolist(),
        "head_prefixes_by_probability_decile": head_seen.astype(int).tolist(),
    }


@click.command()
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--threads", default=2, show_default=True)
@click.option("--new-tokens", default=128, show_default=True)
@click.option("--out", type=click.Path(), default=str(ROOT / "benchmarks" / "results" / "tree_replay.json"))
def main(engine_dir: str, threads: int, new_tokens: int, out: str) -> None:
    from builder.speculation.drafter_prompts import validation_prompts
    from engines.format import SpeculationMethod
    from runner.core.args import EngineArgs
    from runner.core.engine import LLMEngine
    from runner.core.machine import cpu_model

    engine = LLMEngine(EngineArgs(engine_dir, threads=threads))
    spec = engine.speculation
    if spec is None or spec.method != SpeculationMethod.REDRAFTER:
        raise click.UsageError(f"{engine_dir} is not a ReDrafter engine")
    sets = {
        "held_out_chat": [answer(engine, text, new_tokens) for text in HELD_OUT_PROMPTS],
        "validation": [answer(engine, text, new_tokens) for text in validation_prompts()],
    }
    report = {"commit": source_commit(), "engine": engine_dir, "cpu": cpu_model(), "new_tokens": new_tokens}
    for name, answers in sets.items():
        per_limit = {str(limit or "whole"): round(tokens_per_step(spec, answers, limit), 3) for limit in NODE_LIMITS}
        report[name] = {"tokens_per_verify_step": per_limit, **draft_accuracy(spec, answers)}
        click.echo(f"{name} ({len(answers)} prompts): tokens per verify step by node limit {per_limit}")
        click.echo(f"  lookup chain's first d tokens right, d = 1..: {report[name]['lookup_by_depth']}")
        click.echo(f"  head prefixes right, by probability decile: {report[name]['head_by_probability_decile']}")
    Path(out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
