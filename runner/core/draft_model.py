"""A separate draft model (gpt-fast style): a smaller engine of the same vocabulary, built into the target engine's
`draft/` directory, proposes a few tokens per step by greedy decoding (its step graph's argmax, so drafting runs in
its graphs). The target verifies them like any other draft (a tree of one chain) and the sampler graph accepts, so
the output is the target's whatever the draft model says.

The draft model keeps its own KV cache, on the same row ids as the target's. A request's `draft_computed` counts
the context tokens in it. A round first feeds the tokens it lacks (one call for all rows: the target's last token,
and the last draft when all were accepted; in prompt chunks, the prompt the first time and the tokens of steps
that decoded without drafts), whose last argmax is the first draft, then decodes the rest of the draft one token at
a time for all rows at once. Drafting k tokens fed d1..d(k-1) through the draft model, so when the target accepts a
drafts, the first min(a, k-1) of them are in its cache already (`accepted`); the next round writes over the
rejected ones. k is the round's own: as many drafts as the step's trees have room for (rows verified together
share the target's matmul pass), at most the engine's draft length. A request under a grammar or bad words drafts
the draft model's best token among those they allow (its greedy answer under the same masks), which the target,
masked the same way, accepts far more often than the unmasked argmax.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from engines.backends import open_backend
from engines.format import open_artifact
from runner.core.executor import Executor, Scored
from runner.core.request import Request


class DraftModel:
    def __init__(self, directory: Path, threads: int | None = None, verify_checksums: bool = True) -> None:
        artifact = open_artifact(directory, verify_checksums=verify_checksums)
        self.executor = Executor(artifact, open_backend(artifact, threads=threads))
        # the last round's time computing context the target had computed before (a new request's prompt, the tokens
        # of steps that decoded without drafts): owed by the context, not by the round's own drafts
        self.catch_up_seconds = 0.0
        self.max_chain = max(self.executor.verify_phase.steps)
        self.max_seq_len = artifact.manifest.max_seq_len

    def draft(self, requests: list[Request], draft_len: int) -> list[list[int]]:
        """`draft_len` greedy tokens after each request's context (fewer where the sequence ends)."""
        executor = self.executor
        contexts = [r.prompt_token_ids + r.output_token_ids for r in requests]
        first_drafts: dict[int, int] = {}  # the step graph's argmax after each row's context
        chains = []  # (index, first position, tokens) of rows that lack a few tokens
        started = time.perf_counter()
        for index, (request, context) in enumerate(zip(requests, contexts)):
            missing = context[request.draft_computed :]
            if len(missing) <= self.max_chain:
                chains.append((index, request.draft_computed, missing))
                continue
            for start in range(request.draft_computed, len(context), executor.max_chunk):  # in prompt chunks
                scored = executor.prefill(request.row, context[start : start + executor.max_chunk], start)
                first_drafts[index] = _choose(request, [], scored)
        self.catch_up_seconds = time.perf_counter() - started
        if chains:
            fed = executor.extend(
                [requests[i].row for i, _, _ in chains],
                [tokens for _, _, tokens in chains],
                [start for _, start, _ in chains],
            )
            for row, (index, _, _) in enumerate(chains):
                first_drafts[index] = _choose(requests[index], [], fed[row])
        for request, context in zip(requests, contexts):
            request.draft_computed = len(context)
        drafts = [[first_drafts[i]] for i in range(len(requests))]
        for step in range(1, draft_len):
            room = [i for i, c in enumerate(contexts) if len(c) + step <= self.max_seq_len]  # the sequence's end
            if not room:
                break
            decoded = executor.decode(
                [requests[i].row for i in room],
                [drafts[i][-1] for i in room],
                [len(contexts[i]) + step - 1 for i in room],
            )
            for row, i in enumerate(room):
                drafts[i].append(_choose(requests[i], drafts[i], decoded[row]))
        for request, drafted in zip(requests, drafts):
            request.drafts_cached = len(drafted) - 1  # all but the last went through the draft model
        return drafts

    def accepted(self, request: Request, drafts: int) -> None:
        """The target accepted the first `drafts` tokens of this request's last draft."""
        request.draft_computed += min(drafts, request.drafts_cached)

    def free_row(self, row: int) -> None:
        self.executor.cache.free_row(row)


def _choose(request: Request, drafted: list[int], scored: Scored) -> int:
    """The next draft token: the draft graph's argmax, or for a masked request the first maximum among the tokens
    allowed after its output and `drafted` (the argmax where the drafts already break the masks: cut later)."""
    if not request.masked:
        return int(scored.argmax)
    allowed = request.allowed_after(drafted, len(scored.logits))
    if allowed is None:
        return int(scored.argmax)
    return int(np.argmax(np.where(allowed[: len(scored.logits)], scored.logits[: len(allowed)], -np.inf)))
