"""Prefix caching (opt-in: `runner serve --enable-prefix-caching`, `LLM(..., enable_prefix_caching=True)`): a new
request starts from the longest prefix of its prompt whose K/V some cache row already holds, instead of computing
its whole prompt again. On a CPU prefill is what a long prompt costs (~0.5 s for 650 tokens in fp32 on 2 cores),
and chat clients send the whole conversation again every turn.

A row holds K/V for the tokens its request computed: a running request's first `num_computed` context tokens, and,
after the request finished (done, cancelled or disconnected), the same tokens until the row is given to another
request (llama.cpp's server keeps a slot's prompt the same way). A request always takes the lowest free row, as
without prefix caching (a higher row would widen every decode call's batch bucket); when the best prefix sits in
another row, the step first copies those positions' K/V into it (650 positions of the default model are 30 MB of
fp32 K/V: milliseconds, against the prefill they replace). A request matches again when it computes its first own
prompt chunk: requests admitted in the same step (a shared system prompt sent by several clients at once) compute
their prompts one after another, so all but the first find the shared prefix computed by then.

At least the prompt's last token is computed again: its logits choose the first new token. Reused K/V may have been
computed in other chunks or by decode steps, so logits can differ from a fresh prefill's in the last bits (as with
vLLM's prefix caching): greedy tokens can differ at a near-tie, which is why it is not the default.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runner.core.request import Request


@dataclass(frozen=True)
class PrefixCopy:
    """Copy the K/V of positions [0, length) of `source_row` into `target_row` before the step runs."""

    source_row: int
    target_row: int
    length: int


class PrefixIndex:
    """Which tokens' K/V each free row still holds; running rows are read from their requests."""

    def __init__(self) -> None:
        # free row -> the cache salt of the request that computed it, and the tokens whose K/V it holds (positions 0..)
        self._held: dict[int, tuple[str | None, np.ndarray]] = {}

    def hold(self, request: Request) -> None:
        """`request` left its row: the row keeps the K/V of what it computed until the row is given away."""
        context = request.prompt_token_ids + request.output_token_ids
        self._held[request.row] = (request.cache_salt, np.asarray(context[: request.num_computed], np.int64))

    def admit(self, request: Request, running: list[Request]) -> PrefixCopy | None:
        """`request` has just taken `request.row`, or is about to compute its first own prompt chunk (`running`
        includes it then): count the prompt tokens it can reuse (`num_computed`, `num_cached_tokens`) and say which
        copy brings them into its row (None when none or when its row holds them)."""
        prompt = np.asarray(request.prompt_token_ids, np.int64)
        limit = len(prompt) - 1  # the last prompt token is always computed: its logits choose the first new token
        # only K/V computed for requests with the same cache salt (None included): tenants that salt their requests
        # differently cannot learn from a faster first token that another sent the same prompt
        candidates = [(row, tokens) for row, (salt, tokens) in self._held.items() if salt == request.cache_salt] + [
            (r.row, np.asarray((r.prompt_token_ids + r.output_token_ids)[: r.num_computed], np.int64))
            for r in running
            if r.cache_salt == request.cache_salt
        ]
        best_row, best = request.row, 0
        for row, tokens in candidates:
            length = _common_prefix(prompt, tokens, limit)
            if length > best or (length == best and row == request.row):  # a tie goes to the row itself: no copy
                best_row, best = row, length
        self._held.pop(request.row, None)  # what it held is overwritten from now on
        request.num_computed = request.num_cached_tokens = best
        return PrefixCopy(best_row, request.row, best) if best and best_row != request.row else None


def _common_prefix(a: np.ndarray, b: np.ndarray, limit: int) -> int:
    """Length of the common prefix of `a` and `b`, at most `limit`."""
    n = min(len(a), len(b), limit)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
