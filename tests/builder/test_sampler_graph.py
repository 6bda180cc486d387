"""The sampler graph (builder/sampler_graph.py, run by onnxruntime, fed by runner/core/sampler_graph.py): the same as
eager torch on every branch, token for token the numpy reference walk (tests/reference_sampling.py) given the same
uniforms, and the target's distribution by chi-square over many seeded draws (fixed seeds: the verdicts never
change)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from builder import export
from builder.export import export_sampler_graph
from builder.sampler_graph import INPUT_NAMES
from builder.sampler_graph import Sampler as SamplerModule
from engines.format import SamplerSpec
from runner.core.request import Request
from runner.core.sampler_graph import Sampler
from runner.sampling.params import SamplingParams
from runner.speculative.drafts import pack_tree
from tests.reference_sampling import log_softmax, node_distribution, processed_probs, walk_tree

VOCAB, DEPTH, EOS = 24, 3, 2
CANDIDATES = 4  # top-k / top-p from 4 candidates: both the partial-sort and the full-sort branch run


class GraphRunner:
    """The one method of a backend the sampler uses, over the exported graph alone."""

    def __init__(self, path) -> None:
        import onnxruntime as ort

        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def run(self, graph: str, feeds: dict) -> dict:
        names = [o.name for o in self.session.get_outputs()]
        return dict(zip(names, self.session.run(names, feeds)))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The graph exported into a build cache of this module's own: its file, its spec and that cache."""
    directory, cache = tmp_path_factory.mktemp("sampler"), tmp_path_factory.mktemp("build_cache")
    export._sampler_graph.cache_clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLM_ENGINE_BUILDER_CACHE_DIR", str(cache))
        spec = export_sampler_graph(VOCAB, DEPTH, directory, CANDIDATES)
    return directory / spec.file, spec, cache


@pytest.fixture(scope="module")
def graph(exported):
    return GraphRunner(exported[0])


def test_a_build_reads_the_kept_graph_instead_of_exporting_it_again(exported, tmp_path, monkeypatch):
    path, spec, cache = exported
    monkeypatch.setenv("LLM_ENGINE_BUILDER_CACHE_DIR", str(cache))
    monkeypatch.setattr(export, "_export_sampler", lambda *args: pytest.fail("exported again"))
    export._sampler_graph.cache_clear()
    assert export_sampler_graph(VOCAB, DEPTH, tmp_path, CANDIDATES) == spec
    assert (tmp_path / spec.file).read_bytes() == path.read_bytes()


def test_the_kept_graph_is_told_apart_by_shape_source_and_exporter(monkeypatch, tmp_path):
    key = export.sampler_cache_key(VOCAB, DEPTH, CANDIDATES)
    others = {export.sampler_cache_key(VOCAB + 1, DEPTH, CANDIDATES), export.sampler_cache_key(VOCAB, DEPTH + 1, 4)}
    others.add(export.sampler_cache_key(VOCAB, DEPTH, CANDIDATES + 1))
    edited = tmp_path / "sampler_graph.py"
    edited.write_bytes(Path(export.sampler_graph.__file__).read_bytes() + b"# edited\n")
    with monkeypatch.context() as patch:
        patch.setattr(export.sampler_graph, "__file__", str(edited))
        others.add(export.sampler_cache_key(VOCAB, DEPTH, CANDIDATES))
    monkeypatch.setattr(torch, "__version__", "0.0")
    others.add(export.sampler_cache_key(VOCAB, DEPTH, CANDIDATES))
    assert key not in others and len(others) == 5


@pytest.fixture(scope="module")
def sampler(graph):
    return Sampler(graph, SamplerSpec("sampler", DEPTH, 20), VOCAB, {EOS})


def request(params: SamplingParams, seed: int, prompt: list[int], output: list[int]) -> Request:
    return Request("r", None, prompt, params, None, np.random.default_rng(seed), output_token_ids=list(output))


PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.8),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=0.9, top_k=8, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.3),
    SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5),
    SamplingParams(temperature=0.8, min_tokens=6, stop_token_ids=[5], logprobs=3),
    SamplingParams(temperature=0.5, top_k=3),  # alone in a call: top-k from the candidates (a partial sort)
    SamplingParams(temperature=0.5, top_p=0.5),
    SamplingParams(temperature=0.0, logit_bias={3: 5.0, 7: -100.0}),
    SamplingParams(
        temperature=0.8, top_p=0.9, repetition_penalty=1.3, logit_bias={1: 3.0, 2: -2.5, 5: 9.0}, logprobs=2
    ),
]


def random_rows(seed: int, count: int) -> list:
    """Rows of every parameter set: trees of random beams (some sharing prefixes), random logits raised at the
    drafts' tokens by random amounts, random outputs (penalties over output + path matter)."""
    rng = np.random.default_rng(seed)
    rows = []
    for index in range(count):
        params = PARAMS[index % len(PARAMS)]
        output = rng.integers(0, VOCAB, rng.integers(0, 5)).tolist()
        beams = [rng.integers(0, VOCAB, DEPTH).tolist() for _ in range(rng.integers(0, 4))]
        if len(beams) > 1:
            beams[1][:1] = beams[0][:1]  # a shared prefix: siblings below it
        tree = pack_tree(output[-1] if output else 7, beams, DEPTH)
        logits = rng.normal(0.0, 2.0, (len(tree.tokens), VOCAB)).astype(np.float32)
        for child, parent in enumerate(tree.parents[1:], start=1):  # drafts the target likes: paths get walked
            logits[parent, tree.tokens[child]] += rng.uniform(0.0, 6.0)
        rows.append((request(params, 1000 + index, rng.integers(0, VOCAB, 4).tolist(), output), tree, logits))
    return rows


def test_graph_equals_eager_torch(sampler, graph):
    feeds = sampler.feeds(random_rows(0, 2 * len(PARAMS)))
    ours = graph.run("sampler", feeds)
    reference = SamplerModule(DEPTH, CANDIDATES)(*(torch.from_numpy(np.asarray(feeds[name])) for name in INPUT_NAMES))
    for name, value in zip(ours, reference):
        np.testing.assert_allclose(ours[name], value.numpy(), atol=1e-5, err_msg=name)


@pytest.mark.parametrize("mixed", [True, False], ids=["one_call", "a_call_per_parameter_set"])
def test_tokens_and_paths_match_the_reference_walk(sampler, mixed):
    """One call with every parameter set (top_k > CANDIDATES sorts the whole vocabulary for all rows), or a call
    per parameter set (top-k / top-p from the candidates where they suffice)."""
    rows = random_rows(1, 12 * len(PARAMS))
    if mixed:
        sampled = sampler.sample(rows)
    else:
        sampled = [None] * len(rows)
        for group in range(len(PARAMS)):
            for index, result in zip(range(group, len(rows), len(PARAMS)), sampler.sample(rows[group :: len(PARAMS)])):
                sampled[index] = result
    accepted = 0
    for index, ((row_request, tree, logits), result) in enumerate(zip(rows, sampled)):
        params = row_request.params
        uniforms = np.random.default_rng(1000 + index).random((len(tree.tokens), 2)).astype(np.float32)  # as drawn
        stop_ids = sampler.stop_ids(row_request)
        tokens, path = walk_tree(
            logits,
            tree.tokens,
            tree.parents,
            uniforms,
            params,
            row_request.prompt_token_ids,
            row_request.output_token_ids,
            stop_ids,
        )
        assert (result.tokens, result.path) == (tokens, path), params
        accepted += len(path) - 1
        if params.logprobs is not None:
            for token, node, logprob in zip(tokens, path + [path[-1]], result.logprobs):
                expected = log_softmax(logits[node])
                assert logprob.token_id == token and logprob.logprob == pytest.approx(expected[token], abs=1e-5)
                assert [t for t, _ in logprob.top] == np.argsort(-expected, kind="stable")[: params.logprobs].tolist()
    assert accepted > 10  # acceptance paths were walked, not only roots


@pytest.mark.parametrize("params", PARAMS[1:5], ids=["t1", "t0.7_top_p", "t1.3_top_k", "all_filters"])
def test_acceptance_reproduces_the_target_distribution(graph, params):
    """30,000 rows in one call: the same root and three sibling drafts (not the best first), different uniforms."""
    rng = np.random.default_rng(1234)
    logits = rng.normal(0.0, 0.6, size=VOCAB).astype(np.float32)
    target = processed_probs(logits, params)
    order = np.argsort(-target)
    candidates = [int(order[1]), int(order[0]), int(order[6])]
    draws = 30000
    tree = pack_tree(0, [[c] for c in candidates], 1)
    sampler = Sampler(graph, SamplerSpec("sampler", DEPTH, 20), VOCAB, {EOS})
    feeds = sampler.feeds([(request(params, 0, [1], [0]), tree, np.tile(logits, (4, 1)))])
    feeds = {k: np.repeat(v, draws, axis=0) if v.ndim else v for k, v in feeds.items()}
    feeds["uniforms"] = rng.random(feeds["uniforms"].shape).astype(np.float32)
    out = graph.run("sampler", feeds)
    first = out["tokens_out"][:, 0]
    counts = np.bincount(first, minlength=VOCAB)
    keep = target > 0
    assert keep.sum() >= 4  # a distribution worth testing
    assert counts[~keep].sum() == 0  # nothing outside top-k / top-p / min-p ever comes out
    assert (out["count"] > 1).mean() == pytest.approx(target[candidates].sum(), abs=0.01)  # a draft taken w.p. q(draft)
    _, p_value = stats.chisquare(counts[keep], target[keep] / target[keep].sum() * draws)
    assert p_value > 0.001


def test_greedy_takes_the_argmax_child_and_ignores_the_generator(sampler):
    logits = np.array([[0.0, 3.0, 1.0, 2.0] + [-5.0] * (VOCAB - 4)] * 4, np.float32)
    greedy = SamplingParams(temperature=0.0)
    for beams, tokens, path in (([[3], [1]], [1, 1], [0, 2]), ([[3], [2]], [1], [0]), ([], [1], [0])):
        tree = pack_tree(9, beams, 1)
        row = request(greedy, 0, [1], [9])
        state = row.rng.bit_generator.state
        (result,) = sampler.sample([(row, tree, logits)])
        assert (result.tokens, result.path) == (tokens, path)
        assert row.rng.bit_generator.state == state


def test_min_tokens_bans_stop_tokens_by_depth(sampler):
    """Output of 2 tokens, min_tokens 4: the root and a depth-1 node may not pick EOS, a depth-2 node may."""
    logits = np.full((3, VOCAB), -5.0, np.float32)
    logits[:, EOS] = 5.0
    logits[:, 11] = 4.0
    params = SamplingParams(temperature=0.0, min_tokens=4)
    row = request(params, 0, [1], [9, 9])
    (result,) = sampler.sample([(row, pack_tree(9, [[11, 11]], 2), logits)])
    assert result.tokens == [11, 11, EOS] and result.path == [0, 1, 2]
    banned = node_distribution(logits[0], params, [1], [9, 9], {EOS})
    assert banned[EOS] == 0.0


def test_the_greedy_walk_is_taken_only_where_it_is_the_graphs_choice(sampler):
    """Sampler.greedy_walk lets a greedy step skip the graph: where it gives an answer, the graph gives the same
    tokens and path (ties included: the first maximum), for trees of the root alone and of several beams; it gives
    none for every parameter set that can change the choice."""
    rng = np.random.default_rng(3)
    taken = accepted = 0
    for index in range(300):
        params = [
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.0, min_tokens=3),
            SamplingParams(temperature=0.0, stop_token_ids=[5], min_tokens=2),
        ][index % 3]
        output = rng.integers(0, VOCAB, rng.integers(1, 4)).tolist()
        beams = [
            rng.integers(0, 6, rng.integers(1, DEPTH + 1)).tolist() for _ in range(index % 4)
        ]  # small ids: often accepted
        tree = pack_tree(output[-1], beams, DEPTH)
        logits = rng.integers(-3, 3, (len(tree.tokens), VOCAB)).astype(np.float32)  # many ties
        logits[:, :6] += rng.integers(0, 3, (len(tree.tokens), 6))  # drafts and stop tokens often the maximum
        row = request(params, 0, [1], output)
        (expected,) = sampler.sample([(row, tree, logits)])
        walked = sampler.greedy_walk(row, tree, logits.argmax(axis=-1), logits)
        if walked is not None:
            taken += 1
            accepted += len(walked.path) > 1
            assert (walked.tokens, walked.path) == (expected.tokens, expected.path)
        else:
            assert len(row.output_token_ids) < params.min_tokens  # a stop token on the walk was still banned
    assert 100 < taken < 300 and accepted > 30  # every answer occurs
    for params in PARAMS[1:]:  # sampling, penalties, logprobs, logit bias: never
        assert (
            sampler.greedy_walk(request(params, 0, [1], [9]), pack_tree(9, [], 0), np.array([3]), np.zeros((1, VOCAB)))
            is None
        )


class FixedMask:
    """A grammar stand-in that allows a fixed set of tokens."""

    def __init__(self, allowed: np.ndarray) -> None:
        self._allowed = allowed

    def allowed(self) -> np.ndarray:
        return self._allowed


def test_the_greedy_walk_under_a_grammar_is_the_graphs_masked_choice(sampler):
    """A constrained greedy row (one node) walks to the first maximum among the allowed tokens, as the graph picks
    with the others at -inf in its logit_bias row, ties included."""
    rng = np.random.default_rng(5)
    for _ in range(100):
        allowed = rng.random(VOCAB) < 0.3
        allowed[rng.integers(VOCAB)] = True
        row = request(SamplingParams(temperature=0.0), 0, [1], [9])
        row.constraint = FixedMask(allowed)
        logits = rng.integers(-3, 3, (1, VOCAB)).astype(np.float32)
        (expected,) = sampler.sample([(row, pack_tree(9, [], 0), logits)])
        walked = sampler.greedy_walk(row, pack_tree(9, [], 0), logits.argmax(axis=-1), logits)
        assert walked.tokens == expected.tokens and allowed[walked.tokens[0]]
