"""When a speculative engine verifies drafts, and how large its trees are: a per-step cost model from the steps it
has timed.

A verify call costs more than a decode call and emits more tokens per row. Which wins depends on the machine, the
engine and how many rows generate together (a batched decode call already uses the compute a verify call spends on
its extra nodes), so neither a rule of thumb nor a fixed row limit fits every case. The policy times both kinds of
step for each number of generating rows, keeps the tokens a row emits per verify step, and picks for the next step
the kind expected to emit more tokens per second:

    verify:  rows x (tokens per verify step) / (verify step seconds, drafting included)
    plain:   rows / (decode step seconds)

How many nodes a row's tree may have depends on the rows verified together where the target's matmul kernel takes a
fixed number of tokens per pass over the weights (`call_tokens`: 6 for onnxruntime's fp32 kernel on x86-64, 4 on our
int4 kernels' AVX2 tiles): a verify call of more tokens makes a second pass, so the tokens of all rows share that
budget. One row's tree gets all of it, two rows' trees half each, and where a tree would have no room for a draft
the step decodes plain. On the Zen 3 VM, every step verifying, two rows of 3-node trees made 1.24x of plain on the
fp32 target where 6-node trees made 1.07x, and four rows of 2-node trees 0.95x (docs/speculative-decoding.md).

A verify step also tells what trees of fewer nodes would have accepted: a tree of m nodes is the first m nodes of
the larger one (`ranked_drafts`), so a row's emitted tokens with it are 1 + its accepted nodes numbered below m.
The tree sizes of more rows (two rows' trees half the size of one row's) thus have their tokens per verify step
from the one-row steps, which verify most, without verifying at that row count first.

Tokens per verify step is the mean since the engine started, not a recent one: acceptance swings with the text (a
list the lookup drafts copy, a poem the head cannot guess), and a recent mean that fell during one hard answer
would stop verification for the easy answers after it, which no verify step would then measure. It is kept per
tree size: a 2-node tree emits at most 2 tokens a row (~1.5 on chat answers), a 4-node tree ~1.9.

A ReDrafter head's training record gives what to expect before anything is measured: its tokens per verify step on
held-out prompts, which the measured mean of one row's trees starts from as if `prior_rows` rows had emitted it. The
verify steps an engine times first are few and not a fair sample (consecutive steps of one answer's opening, which
often accept nothing), and on a mean of those alone verification can lose its place, then be retried ever less
often, each retry moving the mean little (on the Zen 3 VM, one benchmark run of six kept an int4 ReDrafter engine
plain through 20 answers that way: 24 verify steps in all, 20 of them at openings that accepted nothing).

Each kind is tried at each row count before it is compared (the first timing of each is not kept: it includes
binding the call's buffers), and nothing is compared before `min_verified_rows` rows have verified with the step's
tree size: a row emits 1 to draft_len + 1 tokens a verify step, and the first steps of an answer often accept
nothing, so two steps that did not would stop verification for the next `explore_every` steps of an engine where it
pays. The losing kind is retried after `explore_every` steps at that row count, so a change in load or context
length is seen, and its retry's timing replaces its average, which dates from before the wait: smoothed in, a few
slow verify steps early on (a noisy machine, a new shape's first calls) kept an int4 engine plain through a whole
benchmark on a Zen 4 VM, each retry moving the stale average a fifth of the way; each retry that confirms the choice
doubles the wait (up to `max_explore_every`), since a retried loser costs its loss. Either choice emits the same
tokens (verification is exact); only speed depends on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SMOOTHING = 0.2  # weight of a new timing in the moving averages


@dataclass
class _Retry:
    """When a row count next retries the kind it does not choose."""

    interval: int
    countdown: int
    choice: bool | None = None  # the kind last chosen (True: verify)


@dataclass
class _Timed:
    seconds: float | None = None  # moving average of a step's seconds
    seen: int = 0  # steps timed (the first is not kept)
    stale: bool = False  # not chosen since the average was made: the next timing replaces it

    def record(self, seconds: float) -> None:
        self.seen += 1
        if self.seen == 2 or self.stale:  # (stale only once both kinds were timed and compared)
            self.seconds = seconds
        elif self.seen > 2:
            self.seconds += SMOOTHING * (seconds - self.seconds)
        self.stale = False


@dataclass
class _Accepted:
    rows: int = 0  # rows of verify steps with trees of one size
    tokens: int = 0  # tokens they emitted


@dataclass
class SpeculationPolicy:
    """`max_rows`: a fixed rule instead of the cost model: verify in steps of at most this many generating rows
    (None: the cost model decides). `call_tokens`: the most tokens a verify call scores over all its rows (None: no
    such limit); `max_tree_nodes`: the most nodes of one row's tree (None: the engine's trees whole).
    `min_verified_rows`: rows verified with trees of a size before their tokens per verify step is trusted."""

    max_rows: int | None = None
    call_tokens: int | None = None
    max_tree_nodes: int | None = None
    min_verified_rows: int = 16
    prior_tokens_per_verify: float | None = None  # expected of one row's trees before any verify step (None: nothing)
    prior_rows: int = 32  # the weight of that expectation, in verified rows
    explore_every: int = 32
    max_explore_every: int = 512
    _accepted: dict[int | None, _Accepted] = field(default_factory=dict)  # per tree size (tree_nodes)
    _plain: dict[int, _Timed] = field(default_factory=dict)
    _verify: dict[int, _Timed] = field(default_factory=dict)
    _retries: dict[int, _Retry] = field(default_factory=dict)

    def tree_nodes(self, rows: int) -> int | None:
        """The most nodes, root included, of each row's tree in a step of `rows` generating rows (None: the engine's
        trees whole); under 2 there is no room for a draft, and such a step decodes plain."""
        if self.call_tokens is None:
            return self.max_tree_nodes
        nodes = self.call_tokens // rows
        return nodes if self.max_tree_nodes is None else min(nodes, self.max_tree_nodes)

    def can_verify(self, rows: int) -> bool:
        nodes = self.tree_nodes(rows)
        return nodes is None or nodes >= 2

    def verifies(self, rows: int) -> bool:
        """Whether the next step, with `rows` generating rows, verifies drafts (they are drafted for it) or decodes."""
        if not self.can_verify(rows):
            return False
        if self.max_rows is not None:
            return rows <= self.max_rows
        plain, verify = self._plain.setdefault(rows, _Timed()), self._verify.setdefault(rows, _Timed())
        accepted = self._accepted.get(self.tree_nodes(rows), _Accepted())
        if plain.seconds is None or verify.seconds is None or accepted.rows < self.min_verified_rows:
            return plain.seconds is not None  # each kind timed twice, plain first, then verify to the minimum
        better = self.tokens_per_verify(rows) / verify.seconds > 1.0 / plain.seconds
        retry = self._retries.setdefault(rows, _Retry(self.explore_every, self.explore_every))
        if retry.choice is not None and retry.choice != better:  # the choice turned: watch closely again
            retry.interval = retry.countdown = self.explore_every
        retry.choice = better
        retry.countdown -= 1
        if retry.countdown > 0:
            return better
        retry.interval = min(2 * retry.interval, self.max_explore_every)
        retry.countdown = retry.interval
        (plain if better else verify).stale = True
        return not better

    def plain_burst(self, rows: int, most: int) -> int:
        """How many decode calls in a row a step of `rows` rows that decodes plain may make: 1, or up to `most` where
        the steps after it would decode plain too (the wait before the next retry of the other kind, taken now; a
        burst of calls costs less per token than as many steps)."""
        if not self.can_verify(rows):
            return most
        if self.max_rows is not None:
            return most if rows > self.max_rows else 1
        retry = self._retries.get(rows)
        if retry is None or retry.choice is not False:
            return 1
        steps = min(most, retry.countdown - 1)
        if steps < 2:
            return 1
        retry.countdown -= steps
        return steps

    def record_plain(self, rows: int, seconds: float) -> None:
        self._plain.setdefault(rows, _Timed()).record(seconds)

    def record_verify(
        self, rows: int, seconds: float, emitted: int, row_paths: list[tuple[int, list[int]]] = ()
    ) -> None:
        """A verify step of `rows` rows took `seconds` (drafting for it included) and emitted `emitted` tokens.
        `row_paths`: per row, the tokens it emitted and the tree nodes it accepted below the root (their indices in
        the tree), from which the step's acceptance with every smaller node limit is replayed (the rows' trees of m
        nodes being their first m nodes, `ranked_drafts`): exact for greedy rows, an estimate for sampled ones."""
        self._verify.setdefault(rows, _Timed()).record(seconds)
        limit = self.tree_nodes(rows)
        accepted = self._accepted.setdefault(limit, _Accepted())
        accepted.rows += rows
        accepted.tokens += emitted
        for nodes in range(2, 0 if limit is None else limit):
            smaller = self._accepted.setdefault(nodes, _Accepted())
            for row_emitted, path in row_paths:
                smaller.rows += 1
                smaller.tokens += min(row_emitted, 1 + sum(node < nodes for node in path))

    def tokens_per_verify(self, rows: int = 1) -> float | None:
        """Tokens a row emits per verify step with the trees of a step of `rows` rows: over every such step so far,
        and for one row's trees the prior."""
        nodes = self.tree_nodes(rows)
        accepted = self._accepted.get(nodes, _Accepted())
        verified, tokens = accepted.rows, accepted.tokens
        if self.prior_tokens_per_verify is not None and nodes == self.tree_nodes(1):
            verified, tokens = verified + self.prior_rows, tokens + self.prior_rows * self.prior_tokens_per_verify
        return tokens / verified if verified else None

    def estimates(self) -> dict[int, dict[str, float | int | None]]:
        """Per row count: the tree size and the averages the choice compares (for reports and /metrics)."""
        return {
            rows: {
                "tree_nodes": self.tree_nodes(rows),
                "plain_seconds": self._plain[rows].seconds if rows in self._plain else None,
                "verify_seconds": self._verify[rows].seconds if rows in self._verify else None,
                "tokens_per_verify": self.tokens_per_verify(rows),
            }
            for rows in sorted(set(self._plain) | set(self._verify))
        }
