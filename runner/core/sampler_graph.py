"""The host side of the engine's sampler graph (builder/sampler_graph.py): its inputs from the requests being sampled,
and its outputs as tokens. Every token the runner emits comes out of that graph, or, for greedy rows it would walk by
the argmax alone, from the step graph's argmax output (`greedy_walk`); here only the request's state is turned into
arrays (parameters, what the output holds so far, uniforms from the request's own seeded generator) and the results read
back."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engines.format import SamplerSpec
from runner.core.request import Request
from runner.sampling.logprobs import TokenLogprob
from runner.speculative.drafts import TokenTree


@dataclass(frozen=True)
class SampledRow:
    tokens: list[int]  # emitted: the accepted drafts, then the target's own token
    path: list[int]  # tree nodes whose K/V belong in the cache: the root, then the accepted drafts
    logprobs: list[TokenLogprob] | None  # per emitted token, when the request asked for them


class Sampler:
    def __init__(self, backend, spec: SamplerSpec, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.backend = backend
        self.spec = spec
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def stop_ids(self, request: Request) -> set[int]:
        params = request.params
        return set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)

    @staticmethod
    def may_walk(request: Request) -> bool:
        """Whether a greedy request's tokens may come from the argmax (`greedy_walk`) rather than the sampler graph."""
        params = request.params
        return (
            params.greedy
            and params.logprobs is None
            and not params.penalised
            and not params.logit_bias
            and params.allowed_token_ids is None
        )

    def greedy_walk(
        self, request: Request, tree: TokenTree, argmax: np.ndarray, logits: np.ndarray
    ) -> SampledRow | None:
        """The sampler graph's choice for a greedy request, from the step graph's argmax at every node of its tree
        (`argmax` [>= nodes]): from the root, take the child whose token is the target's argmax while there is one,
        then the argmax itself. Exactly the graph's walk (its greedy choice is the first maximum, as ArgMax's) as
        long as no token on the way is banned; None where the graph must choose: the request wants logprobs,
        penalties, a logit bias or allowed_token_ids, or a stop token comes before min_tokens (the graph then takes
        the best allowed one). Saves a greedy step the sampler call. A request under a grammar or bad words with a
        one-node tree takes the first maximum of `logits` [>= 1, vocab] among the tokens allowed next, which is what
        the graph does with the others at -inf (a larger tree comes with each node's mask on its logits and
        `argmax`, see LLMEngine._verify)."""
        params = request.params
        if not self.may_walk(request):
            return None
        if request.masked and len(tree.tokens) == 1:
            argmax = [int(np.argmax(np.where(request.allowed_next(self.vocab_size), logits[0], -np.inf)))]
        banned_until = params.min_tokens - len(request.output_token_ids)  # tokens emitted before stops are allowed
        stop_ids = self.stop_ids(request) if banned_until > 0 else set()
        node, tokens, path = 0, [], [0]
        while True:
            token = int(argmax[node])
            if len(tokens) < banned_until and token in stop_ids:
                return None
            tokens.append(token)
            child = next(
                (c for c in range(node + 1, len(tree.tokens)) if tree.parents[c] == node and tree.tokens[c] == token),
                None,
            )
            if child is None:
                return SampledRow(tokens, path, None)
            path.append(child)
            node = child

    def sample(self, rows: list[tuple[Request, TokenTree, np.ndarray]]) -> list[SampledRow]:
        """rows: (request, its token tree, the target's logits at the tree's nodes [>= nodes, vocab]). One graph
        call."""
        out = self.backend.run(self.spec.graph, self.feeds(rows))
        sampled = []
        for index, (request, _, _) in enumerate(rows):
            count = int(out["count"][index])
            tokens = out["tokens_out"][index, :count].tolist()
            logprobs = None
            if request.params.logprobs is not None:
                top = request.params.logprobs
                logprobs = [
                    TokenLogprob(
                        token,
                        float(out["logprobs"][index, i]),
                        list(
                            zip(out["top_ids"][index, i, :top].tolist(), out["top_logprobs"][index, i, :top].tolist())
                        ),
                    )
                    for i, token in enumerate(tokens)
                ]
            sampled.append(SampledRow(tokens, out["path"][index, :count].tolist(), logprobs))
        return sampled

    def feeds(self, rows: list[tuple[Request, TokenTree, np.ndarray]]) -> dict[str, np.ndarray]:
        batch, vocab = len(rows), self.vocab_size
        nodes = max(len(tree.tokens) for _, tree, _ in rows)
        feeds = {
            "logits": np.zeros((batch, nodes, vocab), np.float32),
            "tokens": np.zeros((batch, nodes), np.int64),
            "parents": np.full((batch, nodes), -1, np.int64),  # padding nodes: nobody's child
            "ancestors": np.broadcast_to(np.eye(nodes, dtype=bool), (batch, nodes, nodes)).copy(),
            "uniforms": np.zeros((batch, nodes, 2), np.float32),
            "output_counts": np.zeros((batch, vocab), np.float32),
            "prompt_tokens": np.zeros((batch, vocab), bool),
            "banned": np.zeros((batch, vocab), bool),
            "ban_depth": np.zeros(batch, np.int64),
        }
        for name, dtype in (
            ("temperature", np.float32),
            ("top_k", np.int64),
            ("top_p", np.float32),
            ("min_p", np.float32),
            ("repetition_penalty", np.float32),
            ("presence_penalty", np.float32),
            ("frequency_penalty", np.float32),
        ):
            feeds[name] = np.array([getattr(request.params, name) for request, _, _ in rows], dtype)
        for index, (request, tree, logits) in enumerate(rows):
            params, size = request.params, len(tree.tokens)
            feeds["logits"][index, :size] = logits[:size]
            feeds["tokens"][index, :size] = tree.tokens
            feeds["parents"][index, :size] = tree.parents
            feeds["ancestors"][index, :size, :size] = tree.mask
            if not params.greedy:  # a greedy request draws nothing (its tokens do not depend on its generator)
                feeds["uniforms"][index, :size] = request.rng.random((size, 2))
            if params.penalised:
                feeds["output_counts"][index] = np.bincount(request.output_token_ids, minlength=vocab)[:vocab]
                feeds["prompt_tokens"][index, request.prompt_token_ids] = True
            stop_ids = self.stop_ids(request)  # banned until min_tokens
            if len(request.output_token_ids) < params.min_tokens and stop_ids:
                feeds["banned"][index, [t for t in stop_ids if t < vocab]] = True
                feeds["ban_depth"][index] = params.min_tokens - len(request.output_token_ids)
        feeds["want_logprobs"] = np.array(any(request.params.logprobs is not None for request, _, _ in rows))
        feeds["logit_bias"] = np.zeros((batch, vocab), np.float32)
        for index, (request, tree, _) in enumerate(rows):
            params = request.params
            bias = feeds["logit_bias"][index]
            if params.allowed_token_ids is not None:  # the same at every node of a tree: drafts are fine
                bias[:] = -np.inf
                bias[params.allowed_token_ids] = 0.0
            for token, value in params.logit_bias.items():
                bias[token] += value
            # a grammar's or bad words' mask, for a one-node tree (a larger one's masks are on its logits)
            allowed = request.allowed_next(vocab) if len(tree.tokens) == 1 else None
            if allowed is not None:
                bias[~allowed] = -np.inf
        return feeds
