"""The step loop: schedule -> execute on the graphs -> sample -> check stops. Shared by the Python API and the CLI."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

from engines.backends import open_backend
from engines.format import QuantizationSpec, QuantMethod, SpeculationMethod, open_artifact
from runner.core.args import EngineArgs, GenerationConfig
from runner.core.draft_model import DraftModel
from runner.core.executor import Executor, Scored
from runner.core.machine import QUANTIZED_AVX2_ROWS_PER_PASS, cpu_flags, fp32_matmul_rows_per_pass
from runner.core.request import FinishReason, Request
from runner.core.sampler_graph import SampledRow, Sampler
from runner.core.scheduler import Scheduler
from runner.core.tensor_parallel import LeaderExecutor, RankGroup
from runner.core.tokenizer import IncrementalDetokenizer, TextCodec
from runner.sampling.bad_words import BadWords
from runner.sampling.logprobs import TokenLogprob, token_logprobs
from runner.sampling.params import SamplingParams
from runner.sampling.structured import GrammarCompiler, TokenConstraint
from runner.speculative.drafts import PromptLookup, SpeculationStats, TokenTree, pack_tree, ranked_drafts
from runner.speculative.policy import SpeculationPolicy


class PromptError(ValueError):
    """A prompt this engine cannot serve (empty, too long, token ids out of range)."""


@dataclass(frozen=True)
class _Pending:
    """A row the sampler graph chooses tokens for this step."""

    request: Request
    tree: TokenTree  # a verify call's draft tree, or the root alone (the first token after a prompt; plain decode)
    logits: np.ndarray  # the target's logits at the tree's nodes [>= nodes, vocab]
    hidden: np.ndarray  # hidden states at the nodes (where a draft head starts from)
    verified: bool = False  # its nodes' K/V wait in the cache for the accepted path to be kept
    argmax: np.ndarray | None = None  # the step graph's argmax at the tree's nodes


@dataclass(frozen=True)
class TokenEvent:
    """What one step produced for one request: a text increment, and whether the request is done."""

    request: Request
    delta: str
    finished: bool


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.artifact = open_artifact(args.model, verify_checksums=args.verify_checksums)
        manifest = self.artifact.manifest
        self.manifest = manifest
        self.sampling_defaults = (
            dict(manifest.sampling_defaults) if args.generation_config == GenerationConfig.AUTO else {}
        )
        if args.max_model_len is not None and not 2 <= args.max_model_len <= manifest.max_seq_len:
            raise ValueError(
                f"max_model_len must be in [2, {manifest.max_seq_len}] for this engine (built with --max-seq-len "
                f"{manifest.max_seq_len}); got {args.max_model_len}"
            )
        self._max_model_len = args.max_model_len or manifest.max_seq_len
        tokenizer = manifest.tokenizer
        if args.chat_template is not None:
            tokenizer = replace(tokenizer, chat_template=args.chat_template)
        self.codec = TextCodec(self.artifact.path(manifest.tokenizer.file), tokenizer)
        self.ranks = None  # a tensor-parallel engine's other ranks (runner/core/tensor_parallel.py)
        if manifest.tensor_parallel > 1:
            self.ranks = RankGroup(self.artifact, args.threads)
            backend = open_backend(self.ranks.artifact, threads=self.ranks.threads, profile_prefix=args.profile_prefix)
            self.executor = LeaderExecutor(self.ranks.artifact, backend, self.ranks)
        else:
            backend = open_backend(self.artifact, threads=args.threads, profile_prefix=args.profile_prefix)
            self.executor = Executor(self.artifact, backend)
        rows = self.executor.max_rows if args.max_batch is None else args.max_batch
        if not 1 <= rows <= self.executor.max_rows:
            raise ValueError(
                f"max_batch must be in [1, {self.executor.max_rows}] for this engine (built with --max-batch)"
            )
        self.num_scheduler_steps = args.num_scheduler_steps
        self.scheduler = Scheduler(
            rows,
            self.executor.max_chunk,
            prefix_caching=args.enable_prefix_caching,
            shared_chunk=args.shared_prefill_chunk,
        )
        if rows > 1:  # greedy tokens must not depend on the batch a request runs in
            self.executor.pad_single_rows_if_they_round_differently()
        self.sampler = Sampler(backend, manifest.sampler, manifest.model.vocab_size, set(manifest.model.eos_token_ids))
        self.speculation = manifest.speculation  # None for a plain engine
        self.speculative_max_rows = args.speculative_max_rows
        # "auto": the cost model decides each step; None: every step verifies (no step has more rows than the cache)
        # whose trees have room for a draft (SpeculationPolicy.can_verify)
        fixed_rows = {"auto": None, None: rows}.get(args.speculative_max_rows, args.speculative_max_rows)
        # "auto": the tokens of a verify call, all rows' trees together, are kept within the target's matmul pass
        call_tokens = None
        if args.max_verify_nodes == "auto":
            tiles = getattr(backend, "quantized_matmul_tiles", None)
            call_tokens = matmul_rows_per_pass(manifest.quantization, backend.provider, tiles)
        self.speculation_policy = SpeculationPolicy(
            max_rows=fixed_rows,
            call_tokens=call_tokens,
            max_tree_nodes=None if args.max_verify_nodes == "auto" else args.max_verify_nodes,
            prior_tokens_per_verify=None if self.speculation is None else self.speculation.head_tokens_per_verify(),
        )
        # the rows the next step verifies (the policy's choice; none: it decodes plain), with the hidden state drafting
        # starts from
        self._to_draft: list[tuple[Request, np.ndarray]] = []
        self.draft_model = None  # draft-model engines: the draft model, an engine of its own (draft_model.py)
        if self.speculation is not None and self.speculation.method == SpeculationMethod.DRAFT_MODEL:
            self.draft_model = DraftModel(
                self.artifact.path(self.speculation.engine), args.threads, args.verify_checksums
            )
        self.speculation_stats = SpeculationStats()
        self._ids = itertools.count()
        self._grammars: GrammarCompiler | None = None  # made on the first structured-output request
        self._grammars_lock = threading.Lock()  # requests are made on the server's threads
        self._grammar_timeout = args.grammar_timeout

    @property
    def max_verify_nodes(self) -> int | None:
        """The most nodes, root included, of a draft tree when one row verifies (None: the engine's trees whole);
        rows verified together share a matmul pass's tokens (SpeculationPolicy.tree_nodes)."""
        return self.speculation_policy.tree_nodes(1)

    @property
    def max_seq_len(self) -> int:
        """The longest sequence (prompt + output) a request may reach."""
        return self._max_model_len

    def add_request(self, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams) -> Request:
        request = self.new_request(prompt, prompt_token_ids, params)
        self.add(request)
        return request

    def add(self, request: Request) -> None:
        self.scheduler.add(request)

    def new_request(self, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams) -> Request:
        """Validate and tokenize a prompt into a Request, without touching the scheduler (safe from any thread)."""
        return self.new_requests(prompt, prompt_token_ids, params)[0]

    def new_requests(
        self,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> list[Request]:
        """The `params.n` completions of one prompt, as Requests (safe from any thread). Completion i samples with
        seed + i; completions after the first are forks of it: they wait for its prompt's K/V and first logits
        instead of computing the same prompt again (vLLM's parallel sampling; see `_fork`). `cache_salt`: with
        prefix caching, reuse cached K/V only from requests with the same salt (vLLM's)."""
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise PromptError(f"a prompt must be a string, got {type(prompt).__name__}")
            prompt_token_ids = self.codec.encode(prompt)
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        if not prompt_token_ids:
            raise PromptError("the prompt is empty")
        keep = self.max_seq_len - 1 if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
        if keep is not None and len(prompt_token_ids) > keep:  # vLLM's: only the prompt's last k tokens
            prompt_token_ids = prompt_token_ids[-keep:]
            prompt = self.codec.decode(prompt_token_ids, skip_special_tokens=False)  # what the model reads (echo)
        vocab = self.manifest.model.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise PromptError(f"prompt token ids must be in [0, {vocab})")
        for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids or [])):
            if any(t >= vocab for t in ids):
                raise PromptError(f"{name} token ids must be in [0, {vocab})")
        bad_words = (
            BadWords(params.bad_words, lambda text: self.codec.encode(text, add_special_tokens=False))
            if params.bad_words
            else None
        )
        if len(prompt_token_ids) >= self.max_seq_len:
            raise PromptError(
                f"the prompt has {len(prompt_token_ids)} tokens; this engine's max sequence length is "
                f"{self.max_seq_len} (prompt + generated tokens), so at most {self.max_seq_len - 1} prompt tokens"
            )
        requests = []
        for index in range(params.n):
            requests.append(
                Request(
                    constraint=self._constraint(params),
                    bad_words=bad_words,
                    cache_salt=cache_salt,
                    request_id=str(next(self._ids)),
                    prompt=prompt,
                    prompt_token_ids=prompt_token_ids,
                    params=params,
                    detokenizer=IncrementalDetokenizer(self.codec, params.skip_special_tokens),
                    rng=np.random.default_rng(None if params.seed is None else params.seed + index),
                    fork_of=requests[0] if requests else None,
                )
            )
        return requests

    def _constraint(self, params: SamplingParams) -> TokenConstraint | None:
        if params.structured_outputs is None:
            return None
        with self._grammars_lock:
            if self._grammars is None:  # GrammarError (a ValueError) when xgrammar is missing
                self._grammars = GrammarCompiler(
                    self.artifact.path(self.manifest.tokenizer.file),
                    self.manifest.model.vocab_size,
                    sorted(self.manifest.model.eos_token_ids),
                    timeout=self._grammar_timeout,
                )
        return self._grammars.constraint(params.structured_outputs)

    def abort(self, request: Request) -> None:
        if not request.finished:
            self._finish(request, FinishReason.ABORT)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        for fork in self.scheduler.forks_of(request):  # gone before its prompt was computed: they compute it themselves
            fork.fork_of = None
        row = self.scheduler.finish(request, reason)
        if row is not None:
            if self.scheduler.prefix_index is None:  # its cache pages go back to the system now, not when idle
                self.executor.cache.free_row(row)
            if self.draft_model is not None:  # the draft model computes a new request's prompt itself
                self.draft_model.free_row(row)

    def step(self) -> list[TokenEvent]:
        step = self.scheduler.schedule()
        for copy in step.prefix_copies:
            self.executor.cache.copy_prefix(copy.source_row, copy.target_row, copy.length)
        if step.empty:
            return []
        burst = self._burst_steps(step)
        if burst > 1 and (events := self._decode_burst(step.decode, burst)):
            return events
        pending: list[_Pending] = []  # rows whose next tokens the sampler graph chooses this step
        events: list[TokenEvent] = []
        verifying = bool(step.decode) and bool(self._to_draft)
        draft_seconds = self._draft_chosen_rows() if verifying else 0.0
        started = time.perf_counter()
        if verifying:
            pending += self._verify(step.decode)
        elif step.decode:
            if self.speculation is not None:  # a loaded step of a speculative engine: plain
                self.speculation_stats.plain_rows += len(step.decode)
            decoded = self.executor.decode(
                [r.row for r in step.decode],
                [r.output_token_ids[-1] for r in step.decode],
                [r.num_computed for r in step.decode],
            )
            for index, request in enumerate(step.decode):
                request.num_computed += 1
                root = pack_tree(request.output_token_ids[-1], [], 0)
                pending.append(
                    _Pending(
                        request,
                        root,
                        decoded.logits[index, None],
                        decoded.hidden[index, None],
                        argmax=decoded.argmax[index, None],
                    )
                )
        decode_seconds = time.perf_counter() - started
        if step.prefill is not None:
            request, count = step.prefill
            scored = self._prefill(request, count)
            request.num_computed += count
            if not request.prefilling:
                root = pack_tree(request.prompt_token_ids[-1], [], 0)
                for r in [request] + self._fork(request):
                    if r.params.max_tokens == 0:  # the prompt was all it asked for (its prompt logprobs)
                        self._finish(r, FinishReason.LENGTH)
                        events.append(TokenEvent(r, "", True))
                    else:
                        pending.append(
                            _Pending(r, root, scored.logits[None], scored.hidden[None], argmax=scored.argmax[None])
                        )
        if not pending:
            return events
        started = time.perf_counter()
        sampled = self._sample(pending)
        sample_seconds = time.perf_counter() - started
        if self.speculation is not None:
            self.speculation_stats.verify_seconds += sample_seconds  # acceptance is part of verifying
        to_draft = []
        verified_tokens = 0
        row_paths = []  # per verified row: its tokens and the tree nodes it accepted (the policy replays smaller trees)
        for row, result in zip(pending, sampled):
            request, emitted = row.request, 0
            for token, logprob in zip(result.tokens, result.logprobs or [None] * len(result.tokens)):
                events.append(self._emit(request, token, logprob))
                emitted += 1
                if request.finished:
                    break
            if row.verified:
                verified_tokens += emitted
                row_paths.append((emitted, result.path[1:]))
                self.speculation_stats.record(emitted)
                if not request.finished:
                    self.executor.commit(request.row, request.num_computed, result.path)
                    request.num_computed += len(result.path)
                    if self.draft_model is not None:
                        self.draft_model.accepted(request, len(result.path) - 1)
            if self.speculation is not None and not request.finished:
                to_draft.append((request, row.hidden[result.path[-1]]))  # drafting resumes where acceptance stopped
        if self.speculation is not None:
            seconds = draft_seconds + decode_seconds + sample_seconds
            self._plan_next_step(step.decode, verifying, seconds, verified_tokens, row_paths, to_draft)
        return events

    def _plan_next_step(
        self, decoded: list[Request], verified: bool, seconds: float, emitted: int, row_paths: list, to_draft: list
    ) -> None:
        """Time this step's generating rows for the speculation policy, then let it choose whether the next step
        verifies drafts (`to_draft`: every row the next step decodes); that step drafts them first."""
        if decoded and verified:
            self.speculation_policy.record_verify(len(decoded), seconds, emitted, row_paths)
        elif decoded:
            self.speculation_policy.record_plain(len(decoded), seconds)
        verifies = bool(to_draft) and self.speculation_policy.verifies(len(to_draft))
        self._to_draft = to_draft if verifies else []
        if not verifies:  # old drafts would follow another position
            for request, _ in to_draft:
                request.drafts = []

    def _draft_chosen_rows(self) -> float:
        """Draft the rows the last step chose to verify in this one, those still running; returns the seconds it took
        that the step's cost includes. Drafting here rather than at the end of the last step lets that step return its
        tokens first (a draft model's first round computes the prompt: a long prompt's first token waited for it)."""
        to_draft = [(request, hidden) for request, hidden in self._to_draft if not request.finished]
        self._to_draft = []
        if not to_draft:
            return 0.0
        started = time.perf_counter()
        owed_by_context = self._draft(to_draft)
        return time.perf_counter() - started - owed_by_context

    def _burst_steps(self, step) -> int:
        """How many decode calls this step may make in a row: more than one only where every row takes the step
        graph's argmax as its token (greedy, nothing adjusts the logits), no prompt is computed or waits for a row,
        and a speculative engine decodes plain in this step and the steps after it (its policy says for how many); no
        more than any row has room for."""
        if (
            self.num_scheduler_steps < 2
            or not step.decode
            or step.prefill is not None
            or self.scheduler.waiting
            or self._to_draft
            or any(r.masked or not self.sampler.may_walk(r) for r in step.decode)
        ):
            return 1
        rooms = (
            min(r.params.max_tokens - len(r.output_token_ids), self.max_seq_len - r.num_tokens) for r in step.decode
        )
        most = min(self.num_scheduler_steps, *rooms)
        if self.speculation is None:
            return most
        # the step after the burst is a step of its own: its hidden states are where drafting would start
        return self.speculation_policy.plain_burst(len(step.decode), most)

    def _decode_burst(self, requests: list[Request], steps: int) -> list[TokenEvent]:
        """Up to `steps` greedy tokens for each request from decode calls in a row (Executor.decode_greedy), emitted
        in order. The burst ends before a call that chooses a stop token in any row, which the sampler must see
        (min_tokens bans them); no events where that was the first call, and the step goes on as usual."""
        vocab_size = self.manifest.model.vocab_size
        stop = np.zeros(vocab_size, bool)
        for request in requests:
            stop[[t for t in self.sampler.stop_ids(request) if 0 <= t < vocab_size]] = True
        tokens = self.executor.decode_greedy(
            [r.row for r in requests],
            [r.output_token_ids[-1] for r in requests],
            [r.num_computed for r in requests],
            steps,
            stop,
        )
        events = []
        for column in tokens.T.tolist():
            for request, token in zip(requests, column):
                if not request.finished:  # a stop string or the length limit ended it earlier in the burst
                    request.num_computed += 1
                    events.append(self._emit(request, token, None))
        if self.speculation is not None:
            self.speculation_stats.plain_rows += len(events)
        return events

    def _prefill(self, request: Request, count: int) -> Scored:
        """Compute the request's next `count` prompt tokens; returns the last one's logits, argmax and hidden state.
        A request that wants prompt logprobs runs the score phase instead (logits after every token, the same
        computation) and keeps the logprob each prompt token gets from the tokens before it."""
        start = request.num_computed
        tokens = request.prompt_token_ids[start : start + count]
        top = request.params.prompt_logprobs
        if top is None:
            return self.executor.prefill(request.row, tokens, start)
        if start == 0:
            request.prompt_logprobs.append(None)  # nothing predicts the first token
        scored = self.executor.score(request.row, tokens, start)  # its buckets are the prefill chunk's (phases.py)
        # row j predicts the token after it: the next prompt token, or past the prompt's end the first output token
        request.prompt_logprobs += token_logprobs(
            scored.logits, request.prompt_token_ids[start + 1 : start + count + 1], top
        )
        return scored[-1]

    def _fork(self, request: Request) -> list[Request]:
        """`request` has just computed its prompt: the other completions of it that hold a cache row get a copy of
        its prompt's K/V and start from the same logits, which the sampler graph samples with their own seeds; so
        each completes exactly as it would have alone, and the prompt was computed once. Forks still waiting for a
        row compute the prompt themselves when they get one."""
        forked = []
        for fork in self.scheduler.forks_of(request):
            fork.fork_of = None
            if fork.row is not None:
                self.executor.cache.copy_prefix(request.row, fork.row, request.num_computed)
                fork.num_computed = request.num_computed
                fork.prompt_logprobs = list(request.prompt_logprobs)
                forked.append(fork)
        return forked

    def _sample(self, pending: list[_Pending]) -> list[SampledRow]:
        """The sampler graph's choice for every pending row, in one call; greedy rows whose choice the step graph's
        argmax already gives (Sampler.greedy_walk) take it without one."""
        walked = [
            None if p.argmax is None else self.sampler.greedy_walk(p.request, p.tree, p.argmax, p.logits)
            for p in pending
        ]
        to_sample = [(p.request, p.tree, p.logits) for p, row in zip(pending, walked) if row is None]
        sampled = iter(self.sampler.sample(to_sample) if to_sample else [])
        return [next(sampled) if row is None else row for row in walked]

    def _verify(self, requests: list[Request]) -> list[_Pending]:
        """Score each generating request's draft tree (one verify call for all); the sampler graph then accepts."""
        trees = []
        for request in requests:
            room = min(request.params.max_tokens - len(request.output_token_ids), self.max_seq_len - request.num_tokens)
            trees.append(pack_tree(request.output_token_ids[-1], request.drafts, max_depth=max(room - 1, 0)))
        started = time.perf_counter()
        verified = self.executor.verify(
            [r.row for r in requests], [(t.tokens, t.mask) for t in trees], [r.num_computed for r in requests]
        )
        self.speculation_stats.verify_seconds += time.perf_counter() - started
        pending = []
        for index, (request, tree) in enumerate(zip(requests, trees)):
            logits, argmax = verified.logits[index], verified.argmax[index]
            if request.masked and len(tree.tokens) > 1:  # each node's own mask (a one-node tree's: the sampler's)
                masks = request.tree_masks(tree.tokens, tree.parents, self.manifest.model.vocab_size)
                logits = np.where(masks, logits[: len(tree.tokens)], -np.inf).astype(np.float32)
                argmax = logits.argmax(-1)  # the first maximum among allowed tokens, as the sampler graph's choice
            pending.append(_Pending(request, tree, logits, verified.hidden[index], True, argmax))
        return pending

    def _draft(self, requests: list[tuple[Request, np.ndarray]]) -> float:
        """New drafts for this step: the draft graph's beams from each request's hidden state (ReDrafter), the
        draft model's greedy continuation, and/or the continuation of the latest earlier match of the context's last
        tokens (prompt lookup). Returns the seconds of it owed by the context, not by verifying: a draft model
        catching up on a prompt or on steps that decoded plain."""
        for request, _ in requests:
            request.drafts = []
        tree_nodes = self.speculation_policy.tree_nodes(len(requests))  # the rows this step verifies
        # a masked request's tree gets its masks on the logits (`_verify`), which would change the logprobs it asked
        # for (those are the model's own): such a request goes without drafts
        requests = [(r, hidden) for r, hidden in requests if not (r.masked and r.params.logprobs is not None)]
        if not requests:
            return 0.0
        started = time.perf_counter()
        owed_by_context = 0.0
        spec = self.speculation
        lookup_len = spec.draft_len if spec.method == SpeculationMethod.PROMPT_LOOKUP else spec.prompt_lookup_len
        chains = [self._lookup_chain(request, lookup_len) for request, _ in requests]
        beams = [np.zeros((0, 0), np.int64)] * len(requests)
        scores = [None] * len(requests)
        if spec.method == SpeculationMethod.DRAFT_MODEL:  # its greedy continuation is a chain as the lookup draft is
            draft_len = spec.draft_len if tree_nodes is None else min(spec.draft_len, tree_nodes - 1)
            chains = self.draft_model.draft([request for request, _ in requests], draft_len)
            owed_by_context = self.draft_model.catch_up_seconds
        elif spec.method == SpeculationMethod.REDRAFTER:
            # the chain ranks first, so a chain that fills the tree leaves no node to the head: no draft call for it
            headed = [i for i, chain in enumerate(chains) if tree_nodes is None or len(chain) + 1 < tree_nodes]
            if headed:
                drafted = self.executor.draft(
                    np.stack([requests[i][1] for i in headed]), [requests[i][0].output_token_ids[-1] for i in headed]
                )
                for i, row_beams, row_scores in zip(headed, *drafted):
                    beams[i], scores[i] = row_beams, row_scores
        for index, ((request, _), chain) in enumerate(zip(requests, chains)):
            request.drafts = ranked_drafts(
                chain,
                beams[index],
                scores[index],
                spec.min_draft_prob,
                tree_nodes,
            )
            if request.masked:  # a grammar or bad words: a draft ends where they stop allowing it
                request.drafts = [request.draft_prefix(list(beam)) for beam in request.drafts]
        self.speculation_stats.draft_seconds += time.perf_counter() - started
        return owed_by_context

    def _lookup_chain(self, request: Request, lookup_len: int) -> list[int]:
        """The prompt-lookup draft of a request's context ([] where the engine drafts no lookup chain)."""
        if not lookup_len:
            return []
        if request.lookup is None:
            request.lookup = PromptLookup(self.speculation.max_ngram, self.speculation.min_ngram)
        return request.lookup.draft(request.prompt_token_ids + request.output_token_ids, lookup_len)

    def _emit(self, request: Request, token: int, logprob: TokenLogprob | None) -> TokenEvent:
        """Append a chosen token: logprobs, detokenization, stop strings/tokens and length limits."""
        params = request.params
        if logprob is not None:
            request.logprobs.append(logprob)
        request.output_token_ids.append(token)
        if request.constraint is not None:
            request.constraint.accept(token)
        reason = None
        if token in self.sampler.stop_ids(request) or (request.constraint is not None and request.constraint.complete):
            reason = FinishReason.STOP
            # vLLM's stop_reason: a stop token the request named (not the model's own end of sequence)
            if token in params.stop_token_ids and (params.ignore_eos or token not in self.sampler.eos_token_ids):
                request.stop_reason = token
        if reason is None and (
            len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_seq_len
        ):
            reason = FinishReason.LENGTH
        delta = ""
        if params.detokenize:  # (without it: token ids only, and no stop strings, which SamplingParams refuses then)
            delta, reason = self._append_text(request, token, reason)
        if reason is not None:
            self._finish(request, reason)
        return TokenEvent(request, delta, reason is not None)

    def _append_text(
        self, request: Request, token: int, reason: FinishReason | None
    ) -> tuple[str, FinishReason | None]:
        """Detokenize a chosen token: the text increment to show (held back where it could grow into a stop string)
        and the reason to finish, "stop" where a stop string now appears (it wins over a length limit)."""
        params = request.params
        # a stop token's text is not part of the answer
        if reason != FinishReason.STOP or params.include_stop_str_in_output:
            request.detokenizer.push(token)
        full_text = request.detokenizer.text
        visible = full_text
        for stop in params.stop:
            index = full_text.find(stop)
            if index != -1:
                end = index + len(stop) if params.include_stop_str_in_output else index
                visible, reason, request.stop_reason = full_text[:end], FinishReason.STOP, stop
                break
        if reason is None:
            visible = full_text[: len(full_text) - held_back(full_text, params.stop)]
        delta = visible[len(request.text) :]
        request.text = visible
        return delta, reason

    def run(self, requests: list[Request]) -> Iterator[TokenEvent]:
        """Step until every request in `requests` is finished, yielding every event on the way."""
        while any(not r.finished for r in requests):
            yield from self.step()


def matmul_rows_per_pass(
    quantization: QuantizationSpec, provider: str, quantized_tiles: str | None = None
) -> int | None:
    """The most tokens a verify call should score on this CPU, all rows' trees together: the rows of activations the
    target's matmul kernel multiplies in one pass over the weights, beyond which it makes a second pass. fp32:
    onnxruntime's matmul kernel (runner/core/machine.py, docs/measurements.md); our quantized kernels on their AVX2
    tiles (`quantized_tiles`, as the engine's kernel library reports them): 4 rows. None for other quantized kernels
    (our VNNI tiles, onnxruntime's MatMulNBits: a limit there is not measured to pay), on GPUs and on CPUs not
    measured."""
    if provider != "CPUExecutionProvider":
        return None
    if quantization.method == QuantMethod.NONE:
        return fp32_matmul_rows_per_pass(cpu_flags())
    return QUANTIZED_AVX2_ROWS_PER_PASS if quantized_tiles == "avx2" else None


def held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters could still grow into a stop string (not shown yet while streaming)."""
    held = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:size]):
                held = size
                break
    return held
