"""Requests as plain data: what was asked, how far it has been computed, what it produced."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from runner.core.tokenizer import IncrementalDetokenizer
from runner.sampling.bad_words import BadWords
from runner.sampling.logprobs import TokenLogprob
from runner.sampling.params import SamplingParams
from runner.sampling.structured import TokenConstraint
from runner.speculative.drafts import PromptLookup


class FinishReason(str, Enum):
    """Why a request ended (vLLM's and OpenAI's names); it compares equal to its string."""

    STOP = "stop"  # a stop token, a stop string, or a grammar that is complete
    LENGTH = "length"  # max_tokens, or the engine's max_seq_len
    ABORT = "abort"  # cancelled, the client disconnected, or generation failed

    def __str__(self) -> str:
        return self.value


@dataclass
class CompletionOutput:
    """One completion of a prompt (vLLM's CompletionOutput)."""

    index: int  # which of the prompt's n completions (it sampled with seed + index)
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None  # None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (None for EOS or a limit)
    logprobs: list[TokenLogprob] | None = None  # one per generated token when asked for
    cumulative_logprob: float | None = None  # the sum of the generated tokens' logprobs, when they were asked for


@dataclass
class RequestOutput:
    """What one prompt produced: its n completions in `outputs` (vLLM's RequestOutput). For the usual single
    completion, `text`, `token_ids`, `finish_reason` and `logprobs` read it directly."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # when asked for: one per prompt token, None for the first (nothing comes before it), as vLLM's prompt_logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens not computed again: their K/V came from the prefix cache

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    @property
    def only(self) -> CompletionOutput:
        if len(self.outputs) != 1:
            raise ValueError(f"this prompt has {len(self.outputs)} completions (n > 1): read them in .outputs")
        return self.outputs[0]

    @property
    def text(self) -> str:
        return self.only.text

    @property
    def token_ids(self) -> list[int]:
        return self.only.token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.only.finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.only.logprobs


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    rng: np.random.Generator
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (runner/core/prefix_cache.py)
    row: int | None = None  # KV cache row while running
    text: str = ""  # visible text: stop strings cut off, possible stop prefixes held back while running
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # computed so far (params.prompt_logprobs)
    drafts: list | np.ndarray | None = None  # speculative engines: draft beams (token id sequences) for the next step
    draft_computed: int = 0  # draft-model engines: context tokens in the draft model's cache
    drafts_cached: int = 0  # draft-model engines: tokens of the last draft in its cache after them
    lookup: PromptLookup | None = None  # engines with prompt lookup: its index of the request's n-grams
    constraint: TokenConstraint | None = None  # structured outputs: where the request is in its grammar
    bad_words: BadWords | None = None  # token sequences it must not complete
    cache_salt: str | None = None  # prefix caching reuses K/V only from requests with the same salt
    fork_of: Request | None = None  # n > 1: the first completion, whose prompt K/V and first logits this one waits for

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def masked(self) -> bool:
        """Whether the tokens allowed next depend on the tokens before (a grammar, bad words): a draft tree of such
        a request needs a mask per node (`tree_masks`)."""
        return self.constraint is not None or self.bad_words is not None

    def allowed_next(self, vocab_size: int) -> np.ndarray | None:
        """[vocab_size] bool: the tokens the grammar or the bad words allow next; None where nothing is masked."""
        if self.constraint is not None:
            return self.constraint.allowed()
        if self.bad_words is not None:
            return self.bad_words.allowed(self.output_token_ids, vocab_size)
        return None

    def allowed_after(self, drafted: list[int], vocab_size: int) -> np.ndarray | None:
        """[vocab_size] bool: the tokens allowed after the output and then `drafted` (a masked request drafting);
        None where the drafts already break the masks or end the grammar."""
        if self.constraint is not None:
            return self.constraint.allowed_after(drafted)
        return self.bad_words.allowed(self.output_token_ids + drafted, vocab_size)

    def draft_prefix(self, draft: list[int]) -> list[int]:
        """The part of a draft the masks allow (a masked request): the rest could never be accepted."""
        if self.constraint is not None:
            return self.constraint.draft_prefix(draft)
        return self.bad_words.draft_prefix(self.output_token_ids, draft)

    def tree_masks(self, tokens: list[int], parents: list[int], vocab_size: int) -> np.ndarray:
        """[nodes, vocab_size] bool: the tokens allowed after each node of its draft tree (a masked request)."""
        if self.constraint is not None:
            return self.constraint.tree_masks(tokens, parents)
        return self.bad_words.tree_masks(self.output_token_ids, tokens, parents, vocab_size)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def completion(self, index: int = 0) -> CompletionOutput:
        logprobs = list(self.logprobs) if self.params.logprobs is not None else None
        return CompletionOutput(
            index,
            self.text,
            list(self.output_token_ids),
            self.finish_reason,
            self.stop_reason,
            logprobs,
            None if logprobs is None else sum(lp.logprob for lp in logprobs),
        )


def request_output(completions: list[Request]) -> RequestOutput:
    """The output of one prompt from its n requests (in index order)."""
    first = completions[0]
    return RequestOutput(
        first.request_id,
        first.prompt,
        first.prompt_token_ids,
        [r.completion(i) for i, r in enumerate(completions)],
        list(first.prompt_logprobs) if first.params.prompt_logprobs is not None else None,
        first.num_cached_tokens,
    )
