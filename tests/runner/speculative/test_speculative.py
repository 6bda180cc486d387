"""Speculative decoding: tree packing (the acceptance rule itself: tests/builder/test_sampler_graph.py), and a
ReDrafter engine against the plain engine of the same tiny model: greedy identical alone and in inflight batches,
sampled output distributed as the target's."""

from __future__ import annotations

import time

import numpy as np
import pytest
from scipy import stats

from engines.format import QuantizationSpec, QuantMethod
from runner import LLM, SamplingParams
from runner.core.engine import matmul_rows_per_pass
from runner.core.machine import fp32_matmul_rows_per_pass
from runner.sampling.bad_words import BadWords
from runner.speculative.drafts import PromptLookup, pack_tree, ranked_drafts
from tests.reference_sampling import processed_probs

PROMPTS = ["hello world", "The quick brown fox", "Engines compile graphs", "0123456789 hello", "runners batch"]


def test_pack_tree_merges_shared_prefixes():
    beams = np.array([[5, 6, 7], [5, 6, 8], [9, 6, 7]])
    tree = pack_tree(1, beams, max_depth=3)
    assert tree.tokens == [1, 5, 6, 7, 8, 9, 6, 7]
    assert tree.parents == [-1, 0, 1, 2, 2, 0, 5, 6]
    # a node sees exactly its ancestors and itself
    assert tree.mask[4].tolist() == [True, True, True, False, True, False, False, False]
    assert tree.mask[7].tolist() == [True, False, False, False, False, True, True, True]
    shallow = pack_tree(1, beams, max_depth=1)
    assert shallow.tokens == [1, 5, 9] and shallow.parents == [-1, 0, 0]
    assert pack_tree(1, beams, max_depth=0).tokens == [1]


def lookup(tokens: list[int], draft_len: int, min_ngram: int = 1) -> list[int]:
    return PromptLookup(3, min_ngram).draft(tokens, draft_len)


def test_prompt_lookup_continues_the_latest_longest_match():
    assert lookup([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]  # trigram match
    assert lookup([1, 2, 9, 7, 2, 8, 9, 2], 2) == [8, 9]  # the latest "2" wins
    assert lookup([5, 6, 5], 4) == [6, 5]  # fewer tokens left than draft_len
    assert lookup([7, 8, 9], 3) == [] and lookup([1], 3) == [] and lookup([], 3) == []
    assert pack_tree(3, [[4, 5, 1]], max_depth=2).tokens == [3, 4, 5]
    assert pack_tree(3, [[]], max_depth=4).tokens == [3]
    # from two tokens of context on: "2" alone has occurred before, "9 2" has not
    assert lookup([1, 2, 9, 7, 2, 8, 9, 2], 2, min_ngram=2) == []
    assert lookup([1, 2, 3, 4, 5, 1, 2, 3], 3, min_ngram=2) == [4, 5, 1]


def scanned_lookup(tokens: list[int], draft_len: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The lookup by a scan of the whole context, longest n first, the latest occurrence that has a successor."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + draft_len]
    return []


@pytest.mark.parametrize("max_ngram, min_ngram", [(3, 1), (3, 2), (4, 2)])
def test_prompt_lookups_index_grows_with_the_context_and_matches_a_scan(max_ngram, min_ngram):
    rng = np.random.default_rng(max_ngram + min_ngram)
    tokens = rng.integers(0, 6, 40).tolist()  # a small vocabulary: many repeated n-grams
    index = PromptLookup(max_ngram, min_ngram)
    length = 1
    while length <= len(tokens):  # the context grows by 1-4 tokens a call, as a verify step accepts drafts
        context = tokens[:length]
        assert index.draft(context, 4) == scanned_lookup(context, 4, max_ngram, min_ngram), length
        length += int(rng.integers(1, 5))


def test_ranked_drafts_take_the_chain_then_the_likeliest_head_prefixes_up_to_the_node_limit():
    beams = np.array([[5, 6, 7], [8, 9, 4], [1, 2, 3]])
    prefix_logprobs = np.log([[0.9, 0.5, 0.05], [0.3, 0.08, 0.01], [0.02, 0.01, 0.001]])
    # no limit: every prefix the head gives at least min_prob, likeliest first
    assert ranked_drafts([], beams, prefix_logprobs, 0.1, None) == [[5], [5, 6], [8]]
    # the likeliest prefixes across beams: (5) 0.9, (5 6) 0.5, (8) 0.3, (8 9) 0.08, (5 6 7) 0.05, (1) 0.02, then at
    # 0.01 the shallower (1 2) before (8 9 4)
    every = [[5], [5, 6], [8], [8, 9], [5, 6, 7], [1], [1, 2], [8, 9, 4], [1, 2, 3]]
    assert ranked_drafts([], beams, prefix_logprobs, 0.0, None) == every
    for limit in range(2, 12):  # a limit keeps the first choices
        assert ranked_drafts([], beams, prefix_logprobs, 0.0, limit) == every[: limit - 1]
    # the chain (prompt lookup's draft) comes first; what it shares with the head's beams is one node
    assert ranked_drafts([5, 6, 2], beams, prefix_logprobs, 0.0, 4) == [[5], [5, 6], [5, 6, 2]]
    assert ranked_drafts([5, 6, 2], beams, prefix_logprobs, 0.0, 5) == [[5], [5, 6], [5, 6, 2], [8]]
    assert ranked_drafts([4, 4, 4, 4], beams, prefix_logprobs, 0.1, 3) == [[4], [4, 4]]
    for limit in range(2, 12):
        drafts = ranked_drafts([5, 1, 1], beams, prefix_logprobs, 0.0, limit)
        assert len(pack_tree(0, drafts, max_depth=4).tokens) == min(limit, 1 + 3 + 8)  # (5) is shared
    # engines whose draft graph gives no probabilities: shallow prefixes first, beam order within a depth
    assert ranked_drafts([], beams, None, 0.1, 5) == [[5], [8], [1], [5, 6]]
    assert ranked_drafts([], beams, None, 0.1, None)[-3:] == [[5, 6, 7], [8, 9, 4], [1, 2, 3]]
    # a draft model's chain alone, as long as the limit allows
    assert ranked_drafts([3, 1, 4, 1, 5, 9], np.zeros((0, 0), np.int64), None, 0.0, 6) == [
        [3],
        [3, 1],
        [3, 1, 4],
        [3, 1, 4, 1],
        [3, 1, 4, 1, 5],
    ]


def test_a_smaller_node_limit_gives_the_first_nodes_of_the_packed_tree():
    """What lets a verify step's acceptance tell what smaller trees would have accepted: node i of a packed tree is
    the i-th choice, so a limit of m nodes gives the same tree's first m nodes, with the same parents."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        beams = rng.integers(0, 4, (3, 3))  # a small vocabulary: beams share prefixes
        prefix_logprobs = np.sort(np.log(rng.uniform(0.01, 1.0, (3, 3))), axis=1)[:, ::-1]
        chain = rng.integers(0, 4, int(rng.integers(0, 4))).tolist()
        whole = pack_tree(7, ranked_drafts(chain, beams, prefix_logprobs, 0.0, None), max_depth=4)
        for limit in range(2, len(whole.tokens) + 1):
            tree = pack_tree(7, ranked_drafts(chain, beams, prefix_logprobs, 0.0, limit), max_depth=4)
            assert tree.tokens == whole.tokens[:limit] and tree.parents == whole.parents[:limit]


def test_the_node_limit_follows_the_fp32_matmul_kernels_pass():
    assert fp32_matmul_rows_per_pass({"sse2", "avx", "avx2", "fma"}) == 6
    assert fp32_matmul_rows_per_pass({"avx2", "fma", "avx512f"}) == 6  # 12 per pass only from 12 rows on
    assert fp32_matmul_rows_per_pass({"sse2"}) is None and fp32_matmul_rows_per_pass(set()) is None  # not measured
    int4 = QuantizationSpec(QuantMethod.RTN, bits=4)
    assert matmul_rows_per_pass(int4, "CPUExecutionProvider") is None  # onnxruntime's MatMulNBits
    assert matmul_rows_per_pass(int4, "CPUExecutionProvider", "avx2") == 4  # our kernels' AVX2 tiles: 4 rows a pass
    assert matmul_rows_per_pass(int4, "CPUExecutionProvider", "avx512vnni") is None  # not measured to pay
    assert matmul_rows_per_pass(int4, "CUDAExecutionProvider", "avx2") is None
    assert matmul_rows_per_pass(QuantizationSpec(), "CUDAExecutionProvider") is None


@pytest.fixture(scope="module")
def plain(engine_factory):
    return LLM(engine_factory("gqa"))


@pytest.fixture(scope="module")
def spec_engine_dir(engine_factory, tiny_draft_head):
    return engine_factory("gqa", prefill_chunk=8, draft_head=tiny_draft_head[0], beam_width=3, draft_len=4)


def with_oracle_drafts(spec: LLM, plain: LLM, beams) -> LLM:
    """Replace the speculative engine's drafting: `beams(best, context_length, vocab)` gets the plain engine's own
    greedy 4-token continuation of the context and returns the draft beams."""
    vocab = spec.engine.manifest.model.vocab_size
    continuations: dict[tuple[int, ...], list[int]] = {}

    def continuation(context: list[int]) -> list[int]:
        key = tuple(context)
        if key not in continuations:
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            continuations[key] = plain.generate(prompt_token_ids=[context], sampling_params=params)[0].token_ids
        return continuations[key]

    def draft(requests):
        for request, _ in requests:
            context = request.prompt_token_ids + request.output_token_ids
            request.drafts = beams(continuation(context), len(context), vocab)
        return 0.0  # no draft model catching up

    spec.engine._draft = draft
    return spec


@pytest.fixture(scope="module")
def oracle(plain, spec_engine_dir):
    """A speculative engine whose drafts are the plain engine's own greedy continuation, corrupted from a depth that
    varies with the position (so every acceptance length, 0 to 4, occurs), plus two poor beams. Exactness must hold
    whatever the drafts are; good drafts make the acceptance paths run often."""

    def beams(best, length, vocab):
        cut = length % 5
        return [
            best[:cut] + [(t + 1) % vocab for t in best[cut:]],
            best[:1] + [(t + 2) % vocab for t in best[1:]],
            [(t + 3) % vocab for t in best],
        ]

    return with_oracle_drafts(LLM(spec_engine_dir, speculative_max_rows=None), plain, beams)


def test_lookup_beam_deeper_than_the_head_beams_keeps_its_cache_room(plain, engine_factory, tiny_draft_head):
    """Head beams of 1 token plus a prompt-lookup beam of 4: a step can accept 4 drafts, and the cache must have
    room for all of them, also where the path crosses a KV-length bucket (64 positions here)."""
    spec = LLM(
        engine_factory("gqa", draft_head=tiny_draft_head[0], beam_width=2, draft_len=1, prompt_lookup_len=4),
        speculative_max_rows=None,
    )
    with_oracle_drafts(spec, plain, lambda best, length, vocab: [[(best[0] + 1) % vocab], best])
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    for prompt in PROMPTS:
        assert spec.generate(prompt, params)[0].token_ids == plain.generate(prompt, params)[0].token_ids
    assert spec.engine.speculation_stats.accepted_histogram.get(4, 0) > 10


def test_distillation_fits_the_targets_answers(tiny_draft_head):
    """A random tiny model's answers have no structure to generalise from, so on it this checks that distillation
    fits what it is shown (generalisation is measured on the default model: docs/speculative-decoding.md)."""
    _, facts = tiny_draft_head
    losses = facts["epoch_losses"]
    assert len(losses) == 6 and losses[-1] < 0.8 * losses[0], losses
    assert 1 <= facts["kept_epoch"] <= 6 and set(facts["validation_tokens_per_step"]) >= {"beams3_len4", "beams1_len1"}


def test_greedy_speculative_output_equals_plain_greedy(plain, spec_engine_dir, oracle):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    speculation = LLM(spec_engine_dir).engine.speculation
    assert speculation.prompt_lookup_len == 4 and speculation.min_ngram == 2  # beams + a prompt-lookup beam
    assert speculation.min_draft_prob == 0.1  # the head's unlikely drafts are left out of the tree
    whole, limited = (LLM(spec_engine_dir, speculative_max_rows=None, max_verify_nodes=limit) for limit in (None, 3))
    tree_sizes, drafted_rows, chains = [], [], []
    verify, draft = limited.engine.executor.verify, limited.engine.executor.draft
    lookup_chain = limited.engine._lookup_chain
    limited.engine.executor.draft = lambda hidden, tokens: (drafted_rows.append(len(tokens)), draft(hidden, tokens))[1]
    limited.engine._lookup_chain = lambda request, length: (chains.append(lookup_chain(request, length)), chains[-1])[1]
    limited.engine.executor.verify = lambda rows, trees, starts: (
        tree_sizes.extend(len(t) for t, _ in trees),
        verify(rows, trees, starts),
    )[1]
    for spec in (
        whole,
        limited,
        oracle,
    ):  # the distilled head's draft graph + lookup (all of it, then 3-node trees), then oracle drafts
        spec.engine.speculation_stats.__init__()
        assert [spec.generate(p, params)[0].token_ids for p in PROMPTS] == expected
        # inflight: prompts of different lengths join while others generate (prefill chunks of 8 tokens
        # interleave with verify steps), rows accept different numbers of drafts
        assert [o.token_ids for o in spec.generate(PROMPTS * 2, params)] == expected * 2
    assert max(tree_sizes) == 3  # the limit holds (outputs equal plain decoding with it, above)
    # a lookup chain of 2 fills a 3-node tree: the head drafts only for the other rows
    filled = sum(len(chain) >= 2 for chain in chains)
    assert filled > 0 and sum(drafted_rows) == len(chains) - filled
    histogram = oracle.engine.speculation_stats.accepted_histogram
    assert oracle.engine.speculation_stats.mean_accepted > 2.0 and set(histogram) == {0, 1, 2, 3, 4}, histogram


def test_limits_stops_and_logprobs_match_plain_decoding(plain, oracle):
    spec = oracle
    for params in (
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=["o"]),
        SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=10),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias={5: 4.0, 9: 2.0, 11: -3.0}),
    ):
        for prompt in PROMPTS[:3]:
            a, b = plain.generate(prompt, params)[0], spec.generate(prompt, params)[0]
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
            if params.logprobs is not None:
                assert [x.token_id for x in a.logprobs] == [x.token_id for x in b.logprobs]
                np.testing.assert_allclose([x.logprob for x in a.logprobs], [x.logprob for x in b.logprobs], atol=1e-4)


def test_loaded_steps_decode_plain_and_speculation_resumes_when_load_drops(engine_factory, tiny_draft_head, plain):
    """With speculative_max_rows 1, steps with several generating rows decode without drafts and a row left alone
    speculates again: the tokens are plain decoding's either way."""
    spec = LLM(
        engine_factory("gqa", prefill_chunk=8, draft_head=tiny_draft_head[0], beam_width=3, draft_len=4),
        speculative_max_rows=1,
    )
    bursts = []
    decode_greedy = spec.engine.executor.decode_greedy
    spec.engine.executor.decode_greedy = lambda rows, *args: (bursts.append(len(rows)), decode_greedy(rows, *args))[1]
    lengths = [8, 40, 12]  # the 40-token answer ends alone
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outputs = spec.generate(PROMPTS[:3], params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain.generate(PROMPTS[:3], params)]
    stats = spec.engine.speculation_stats
    assert stats.plain_rows > 0 and stats.verify_steps > 0
    assert bursts and min(bursts) > 1  # plain steps of several rows ran as decode calls in a row
    assert stats.emitted_tokens + stats.plain_rows + 3 == sum(lengths)  # every token by one path (first ones: prefill)
    with pytest.raises(ValueError, match="speculative_max_rows"):
        LLM(engine_factory("gqa"), speculative_max_rows=0)


def test_the_cost_model_picks_each_steps_kind_from_measured_times_and_keeps_plain_tokens(
    engine_factory, tiny_draft_head, plain
):
    """By default ("auto") the policy times plain and verify steps per number of generating rows and picks the
    faster: both kinds run, and the tokens are plain decoding's whichever it picks."""
    spec = LLM(engine_factory("gqa", prefill_chunk=8, draft_head=tiny_draft_head[0], beam_width=3, draft_len=4))
    assert spec.engine.speculative_max_rows == "auto"
    lengths = [8, 40, 12]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outputs = spec.generate(PROMPTS[:3], params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain.generate(PROMPTS[:3], params)]
    stats, policy = spec.engine.speculation_stats, spec.engine.speculation_policy
    assert stats.plain_rows > 0 and stats.verify_steps > 0  # each kind is timed before they are compared
    assert stats.emitted_tokens + stats.plain_rows + 3 == sum(lengths)
    assert policy.prior_tokens_per_verify == spec.engine.speculation.head["validation_tokens_per_step"]["beams3_len4"]
    timed = policy.estimates()
    assert timed[1]["plain_seconds"] > 0 and timed[1]["verify_seconds"] > 0 and policy.tokens_per_verify() >= 1


def test_sequence_end_limits_the_tree(engine_factory, tiny_draft_head):
    head, _ = tiny_draft_head
    plain = LLM(engine_factory("gqa", max_seq_len=64))
    spec = LLM(engine_factory("gqa", max_seq_len=64, draft_head=head), speculative_max_rows=None)
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    a, b = plain.generate(PROMPTS[0], params)[0], spec.generate(PROMPTS[0], params)[0]
    assert a.token_ids == b.token_ids and b.finish_reason == "length"
    assert len(b.prompt_token_ids) + len(b.token_ids) == 64


def test_sampled_second_token_follows_the_target_distribution(plain, oracle):
    """The first token comes from prefill, the second from the first verify step (accepted draft or residual
    sample): over many seeds its histogram must match sum_x p(x | prompt) p(y | prompt, x), computed exactly
    from the plain engine's logits."""
    assert_second_token_distribution(plain, oracle, bad_words=[])


def test_sampled_second_token_under_bad_words_follows_the_masked_distribution(plain, oracle):
    """The same with bad words, whose masks go on each tree node's logits: the words are likely second tokens (the
    drafts, the plain engine's unmasked greedy continuation, often propose them), so the masks move much of the
    probability."""
    prompt = plain.tokenizer.encode(PROMPTS[1])
    executor = plain.engine.executor
    first = executor.prefill(0, prompt, 0).logits
    second = executor.decode([0], [int(np.argmax(first))], [len(prompt)]).logits[0]
    executor.cache.release()
    encode = lambda text: plain.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    likely = [plain.tokenizer.decode([int(t)]) for t in np.argsort(-second)[:40]]
    words = [word for word in likely if word.strip() and len(encode(word.strip())) == 1][:8]
    assert len(words) >= 4
    assert_second_token_distribution(plain, oracle, bad_words=words)


def assert_second_token_distribution(plain, spec, bad_words):
    params = SamplingParams(temperature=1.0, top_p=0.95)
    prompt = plain.tokenizer.encode(PROMPTS[1])
    executor = plain.engine.executor
    banned = BadWords(bad_words, lambda text: plain.tokenizer.encode(text, add_special_tokens=False)).banned

    def masked(logits: np.ndarray, output: list[int]) -> np.ndarray:
        logits = logits.copy()
        logits[banned(output)] = -np.inf
        return logits

    first = processed_probs(masked(executor.prefill(0, prompt, 0).logits, []), params)
    expected = np.zeros_like(first)
    for token in np.flatnonzero(first > 1e-6):
        logits = executor.decode([0], [int(token)], [len(prompt)]).logits[0]
        expected += first[token] * processed_probs(masked(logits, [int(token)]), params)
    executor.cache.release()

    runs = 2400
    spec.engine.speculation_stats.__init__()
    outputs = spec.generate(
        prompt_token_ids=[prompt] * runs,
        sampling_params=[
            SamplingParams(max_tokens=3, temperature=1.0, top_p=0.95, seed=s, ignore_eos=True, bad_words=bad_words)
            for s in range(runs)
        ],
    )
    counts = np.bincount([o.token_ids[1] for o in outputs], minlength=len(expected)).astype(float)
    assert not any(o.token_ids[i] in banned(o.token_ids[:i]) for o in outputs for i in range(3))
    # a real share of second tokens are accepted drafts, not only residual samples
    assert spec.engine.speculation_stats.accepted_histogram.get(1, 0) > runs / 10
    frequent = expected * runs >= 5
    observed = np.append(counts[frequent], counts[~frequent].sum())
    wanted = np.append(expected[frequent], expected[~frequent].sum()) * runs
    _, p_value = stats.chisquare(observed, wanted * observed.sum() / wanted.sum())
    assert p_value > 0.001


def test_prompt_lookup_engine_equals_plain_greedy(plain, engine_factory):
    spec = LLM(
        engine_factory("gqa", prefill_chunk=8, speculative="prompt-lookup", draft_len=4), speculative_max_rows=None
    )
    assert spec.engine.speculation.method == "prompt-lookup"
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [p + " " + p for p in PROMPTS]  # repeated text: the context has n-grams to copy from
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert [spec.generate(p, params)[0].token_ids for p in prompts] == expected
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    assert spec.engine.speculation_stats.verify_steps > 0
    # masks: allowed_token_ids apply at every node of a tree (drafted); bad words depend on the path (not drafted)
    allowed = sorted(set(expected[0][:10]))
    words = [plain.tokenizer.decode(expected[1][3:5])]
    for masked in (
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, allowed_token_ids=allowed),
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, bad_words=words),
    ):
        want = [o.token_ids for o in plain.generate(prompts, masked)]
        assert want != [e[:24] for e in expected]
        assert [o.token_ids for o in spec.generate(prompts, masked)] == want


LONG_PROMPT = " ".join(PROMPTS * 3)  # several prompt chunks of 8: the draft model catches up in chunks too


def test_draft_model_engine_equals_plain_greedy(plain, engine_factory):
    """A different tiny model (MQA, untied) drafts for the GQA target: whatever it proposes, output is the target's."""
    spec = LLM(engine_factory("gqa", prefill_chunk=8, draft_model="mqa", draft_len=3), speculative_max_rows=None)
    assert spec.engine.speculation.method == "draft-model" and spec.engine.speculation.draft_len == 3
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS + [LONG_PROMPT]
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert [spec.generate(p, params)[0].token_ids for p in prompts] == expected
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    assert spec.engine.speculation_stats.verify_steps > 0


def test_a_model_drafting_for_itself_has_its_drafts_accepted(plain, engine_factory):
    """The target's own weights as the draft model (fp32): every draft is the target's greedy token, so each step
    emits draft_len + 1 tokens until the end of the answer cuts the tree: only right if the draft model's cache
    holds exactly the context (catch-up after accepted drafts, the prompt in chunks, batched rows)."""
    spec = LLM(
        engine_factory("gqa", prefill_chunk=8, draft_model="gqa", draft_len=3, draft_quant="none"),
        speculative_max_rows=None,
        max_verify_nodes=None,  # whole trees for the 4 rows too
    )
    params = SamplingParams(max_tokens=41, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS[:3] + [LONG_PROMPT]
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    stats = spec.engine.speculation_stats
    # 41 tokens = the first (from the prompt) + 10 steps of 4 per request
    assert stats.verify_steps == 10 * len(prompts) and stats.accepted_histogram == {3: 10 * len(prompts)}


def test_a_draft_model_drafts_only_what_the_steps_trees_have_room_for(plain, engine_factory):
    """Rows verified together share the target's matmul pass: with 6 tokens a call, one row's tree has room for 5
    drafts (3, the engine's draft length, here), two rows' 2 each, three rows' 1 each, and four rows decode plain; the
    draft model drafts no token that no tree has room for. Drafting for itself, it is still right every time (its
    cache holds exactly the context whatever each round drafted)."""
    spec = LLM(
        engine_factory("gqa", prefill_chunk=8, draft_model="gqa", draft_len=3, draft_quant="none"),
        speculative_max_rows=None,
        max_verify_nodes=None,
    )
    spec.engine.speculation_policy.call_tokens = 6  # the fp32 kernel's pass on x86-64, on any machine
    drafted = []  # (rows, tokens drafted per row) of each draft round
    draft = spec.engine.draft_model.draft

    def recording(requests, draft_len):
        chains = draft(requests, draft_len)
        drafted.append((len(requests), {len(chain) for chain in chains}))
        return chains

    spec.engine.draft_model.draft = recording
    prompts, lengths = PROMPTS[:4], [24, 40, 56, 80]  # four rows, then three, two, one
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    assert {rows for rows, _ in drafted} == {1, 2, 3}
    for rows, lengths_drafted in drafted:
        assert lengths_drafted == {min(3, 6 // rows - 1)}, (rows, lengths_drafted)
    stats = spec.engine.speculation_stats
    # every draft accepted, but where an answer's end cut its last tree (by at most 3 drafts)
    drafts = sum(rows * lengths_drafted.pop() for rows, lengths_drafted in drafted)
    assert stats.plain_rows > 0 and stats.emitted_tokens - stats.verify_steps >= drafts - 3 * len(prompts)


def _slow_catch_up(engine_factory, monkeypatch) -> tuple[LLM, list[float]]:
    """A draft-model engine whose draft model takes 0.2 s more per prompt chunk, and the verify step times its cost
    model is given."""
    spec = LLM(engine_factory("gqa", prefill_chunk=8, draft_model="mqa", draft_len=3), speculative_max_rows=None)
    draft_executor = spec.engine.draft_model.executor
    prefill = draft_executor.prefill
    monkeypatch.setattr(draft_executor, "prefill", lambda *args: (time.sleep(0.2), prefill(*args))[1])
    timed = []
    record_verify = spec.engine.speculation_policy.record_verify
    monkeypatch.setattr(
        spec.engine.speculation_policy,
        "record_verify",
        lambda rows, seconds, *accepted: (timed.append(seconds), record_verify(rows, seconds, *accepted))[1],
    )
    return spec, timed


def test_the_cost_model_does_not_charge_a_draft_models_catch_up_to_verifying(engine_factory, monkeypatch):
    """A draft model computes a new request's prompt, and the tokens of steps that decoded plain, in its first round
    after them: owed by the context, not by verifying. Charged to that round's verify step, it made verification look
    dearer after every plain stretch (so it stayed plain). Here catching up takes 0.2 s, and no verify step is timed
    at that."""
    spec, timed = _slow_catch_up(engine_factory, monkeypatch)
    spec.generate([LONG_PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert timed and max(timed) < 0.2


def test_a_step_that_drafts_no_row_owes_no_catch_up(engine_factory, monkeypatch):
    """A request under bad words that asks for logprobs goes without drafts, so its verify step makes no draft round:
    the catch-up of the draft model's last round (another request's prompt, 0.2 s here) is not taken off its time."""
    spec, timed = _slow_catch_up(engine_factory, monkeypatch)
    spec.generate([LONG_PROMPT], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert spec.engine.draft_model.catch_up_seconds >= 0.2  # its one draft round computed the prompt
    masked = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, bad_words=["hello"], logprobs=1)
    spec.generate([PROMPTS[1]], masked)
    assert len(timed) > 1 and min(timed) > 0


def test_a_step_returns_its_tokens_before_the_next_steps_drafts_are_made(engine_factory):
    """The step that emits a request's first token does not also draft for the step after it (a draft model's first
    round computes the whole prompt): the step that verifies drafts first."""
    spec = LLM(engine_factory("gqa", prefill_chunk=8, draft_model="mqa", draft_len=3), speculative_max_rows=None)
    engine = spec.engine
    rounds = []
    draft = engine.draft_model.draft
    engine.draft_model.draft = lambda requests, draft_len: (rounds.append(len(requests)), draft(requests, draft_len))[1]
    request = engine.add_request("hello world", None, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    while not request.output_token_ids:
        engine.step()
    assert rounds == []
    engine.step()
    assert rounds == [1] and len(request.output_token_ids) > 1


def test_draft_model_must_share_the_targets_tokenizer(checkpoint_factory, tmp_path):
    from builder.build import BuildOptions, build_engine
    from tests.builder.test_loaders import copy_with_config

    foreign = copy_with_config(
        checkpoint_factory("mqa"), tmp_path / "foreign", lambda c: c.update(vocab_size=c["vocab_size"] + 1)
    )
    options = BuildOptions(
        str(checkpoint_factory("gqa")), tmp_path / "engine", speculative="draft-model", draft_model=str(foreign)
    )
    with pytest.raises(ValueError, match="does not share the target's tokenizer"):
        build_engine(options, log=lambda line: None)
    with pytest.raises(ValueError, match="needs --draft-model"):
        build_engine(
            BuildOptions(str(checkpoint_factory("gqa")), tmp_path / "e2", speculative="draft-model"), log=lambda _: None
        )
    assert not (tmp_path / "engine").exists()


def test_draft_model_drafts_are_its_own_greedy_continuation(engine_factory):
    """With an int4 copy of the target drafting, some drafts are accepted and some not (every acceptance length
    occurs), and the draft cache reuses the accepted ones: each round's draft must still be what the draft engine
    alone, from scratch, continues the context with. The int4 matmuls quantize activations to int8, so the two ways
    of filling the cache (chunks of other sizes, batched rows) round differently: where a draft token differs, the
    lone engine's logits of both tokens must be a near tie (a wrong cache moves logits by far more)."""
    engine_dir = engine_factory("gqa", prefill_chunk=8, draft_model="gqa", draft_len=3, draft_quant="int4")
    spec = LLM(engine_dir, speculative_max_rows=None)
    drafted: list[tuple[list[int], list[int]]] = []
    draft = spec.engine.draft_model.draft

    def recording(requests, draft_len):
        beams = draft(requests, draft_len)
        drafted.extend((r.prompt_token_ids + r.output_token_ids, beam) for r, beam in zip(requests, beams))
        return beams

    spec.engine.draft_model.draft = recording
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    spec.generate(PROMPTS + [LONG_PROMPT], params)
    assert set(spec.engine.speculation_stats.accepted_histogram) == {0, 1, 2, 3}
    alone = LLM(engine_dir / "draft")
    checked = [(context, beam) for context, beam in drafted if len(context) + 3 <= 256][::3]
    continuations = alone.generate(
        prompt_token_ids=[c for c, _ in checked],
        sampling_params=SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
    )
    mismatches = 0
    for (context, beam), alone_output in zip(checked, continuations):
        alone_tokens = alone_output.token_ids[: len(beam)]  # rows verified together draft fewer tokens each
        if alone_tokens == beam:
            continue
        mismatches += 1
        first = next(i for i, (a, b) in enumerate(zip(beam, alone_tokens)) if a != b)
        logits = _scored_logits(alone, context + beam[:first])
        assert abs(logits[beam[first]] - logits[alone_tokens[first]]) < 0.05, (context, beam, alone_tokens)
    assert mismatches <= len(checked) // 10


def _scored_logits(llm: LLM, token_ids: list[int]) -> np.ndarray:
    """The engine's next-token logits after `token_ids`, by its score phase from an empty cache."""
    executor = llm.engine.executor
    *_, last = executor.score_chunks(token_ids)
    executor.cache.release()
    return last.logits[-1]


@pytest.mark.parametrize("ours", [True, False], ids=["our kernels", "onnxruntime's matmul kept"])
def test_speculating_on_int8_activations_warns_only_where_onnxruntimes_kernels_stay(checkpoint_factory, tmp_path, ours):
    """Our kernels verify a tree's tokens bit for bit as decode steps compute them (over an int8 KV cache too);
    onnxruntime's round differently, which int8 activations grow into whole logits."""
    from builder.build import BuildOptions, build_engine
    from plugins import native_ops

    if ours and native_ops.unavailable_reason():
        pytest.skip(f"our kernels cannot be built here: {native_ops.unavailable_reason()}")
    lines: list[str] = []
    build_engine(
        BuildOptions(
            str(checkpoint_factory("gqa")),
            tmp_path / "engine",
            max_seq_len=128,
            prefill_chunk=32,
            quant="int8",
            speculative="prompt-lookup",
            native_quantized_matmul=ours,
            kv_cache_dtype="int8",
        ),
        log=lines.append,
    )
    warnings = [line for line in lines if line.startswith("warning: this target quantizes activations to int8")]
    assert not warnings if ours else "--onnxruntime-quantized-matmul" in warnings[0]
    assert not any("cache" in line for line in warnings)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"], ids=["float cache", "int8 cache"])
def test_an_int8_activation_engine_speculates_to_its_plain_greedy_tokens(engine_factory, kv_cache_dtype):
    """int4 weights with int8 activations: any rounding difference between a verify call and decode steps could
    flip an activation's int8 code and part the answers; our kernels make them agree bit for bit, over an int8 KV
    cache as over a float one."""
    from plugins import native_ops

    if native_ops.unavailable_reason():
        pytest.skip(f"our kernels cannot be built here: {native_ops.unavailable_reason()}")
    plain = LLM(engine_factory("gqa", quant="int4", prefill_chunk=8, kv_cache_dtype=kv_cache_dtype))
    spec = LLM(
        engine_factory(
            "gqa",
            quant="int4",
            prefill_chunk=8,
            speculative="prompt-lookup",
            draft_len=4,
            kv_cache_dtype=kv_cache_dtype,
        ),
        speculative_max_rows=None,
    )
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=0)
    prompts = [p + " " + p for p in PROMPTS]

    def answers(outputs):  # the tokens and their log-probabilities, which must agree bit for bit
        return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outputs]

    expected = answers(plain.generate(prompts, params))
    assert [answers(spec.generate(p, params))[0] for p in prompts] == expected
    assert answers(spec.generate(prompts, params)) == expected
    assert spec.engine.speculation_stats.mean_accepted > 1  # drafts were accepted, not only verified


def test_an_int4_target_on_the_avx2_tiles_verifies_4_tokens_a_call_shared_by_its_rows(
    engine_factory, tiny_draft_head, monkeypatch
):
    monkeypatch.setenv("LLM_ENGINE_BUILDER_KERNEL_ISA", "avx2")
    engine = engine_factory("gqa", quant="int4", draft_head=tiny_draft_head[0], beam_width=3, draft_len=4)
    spec = LLM(engine, speculative_max_rows=None)
    assert spec.engine.max_verify_nodes == 4
    assert LLM(engine, max_verify_nodes=None).engine.max_verify_nodes is None
    assert LLM(engine, max_verify_nodes=3).engine.speculation_policy.tree_nodes(2) == 3  # a fixed limit: every step
    calls = []  # (rows, nodes of the largest tree) of each verify call
    verify = spec.engine.executor.verify
    spec.engine.executor.verify = lambda rows, trees, starts: (
        calls.append((len(rows), max(len(t) for t, _ in trees))),
        verify(rows, trees, starts),
    )[1]
    prompts, lengths = [PROMPTS[0], PROMPTS[1], LONG_PROMPT], [24, 12, 40]  # three rows, then two, then one
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    plain = LLM(engine_factory("gqa", quant="int4"))
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    assert {rows for rows, _ in calls} == {1, 2}  # three rows' trees would have had no room for a draft
    assert all(rows * nodes <= 4 for rows, nodes in calls) and (2, 2) in calls
    assert max(nodes for rows, nodes in calls if rows == 1) > 2  # a row alone has the call's tokens to itself
    assert spec.engine.speculation_stats.plain_rows > 0
