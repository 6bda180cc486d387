"""Sampling and speculative acceptance as a graph of the engine (`sampler.onnx`, no weights).

Every token the engine emits is chosen here: the first token after a prompt, a plain decode step (a tree of one
node) and a speculative verify step (a tree of draft tokens), so drafting, verification and acceptance all run in
the engine's graphs and the runner only moves tokens and positions. Randomness comes in as uniforms drawn from each
request's seeded generator, so the graph is deterministic and a seed gives the same tokens alone or in a batch.

A row is a token tree: node 0 is the root (the last token, whose logits give the next one), every other node a
draft token under its parent. At node n the target's distribution q_n is exactly what plain decoding would sample
from there: the logits with vLLM's repetition / presence / frequency penalties over the prompt, the output so far
and the drafts on the path down to n; stop tokens banned while the output is shorter than min_tokens; then
temperature, top-k, top-p and min-p (temperature 0: a point mass on the argmax).

Acceptance is modified rejection sampling with point-mass drafts (runner/speculative/drafts.py explains why it is
exact): a node's children are tried in order, child c accepted when u_c * (1 - S_c) < q_n(c), S_c being the mass of its
earlier siblings; the first accepted child is followed; where none is, the token is drawn from q_n with the
children's tokens removed (a leaf: from q_n, the bonus token). The tests of all children and the draws at all
nodes are computed at once (each node owns its uniforms), then the path is walked down to the build-time depth.

Inputs ([B] rows, [N] nodes, [V] vocabulary):
  logits [B, N, V]; tokens, parents [B, N] int64 (parent -1: the root and padding nodes); ancestors [B, N, N]
  bool (a node's ancestors and itself); uniforms [B, N, 2] (u_test, u_draw per node); temperature, top_p, min_p,
  repetition_penalty, presence_penalty, frequency_penalty [B] float32; top_k [B] int64 (<= 0: off);
  output_counts [B, V] float32 (occurrences in the output so far); prompt_tokens [B, V] bool; banned [B, V] bool
  and ban_depth [B] int64 (banned tokens are excluded at nodes shallower than ban_depth); want_logprobs [] bool;
  logit_bias [B, V] float32 (OpenAI's logit_bias, added to the logits before everything else, as vLLM does).
Outputs ([D] = the deepest tree the engine verifies):
  tokens_out [B, D + 1] (the emitted tokens, count of them valid), count [B] int64, path [B, D + 1] int64 (the nodes
  whose K/V the cache keeps: path[0] = the root ... path[count - 1]), and when want_logprobs, for each emitted
  token the model's own log-probability (before penalties and filters, vLLM's default) and the top-20:
  logprobs [B, D + 1], top_ids [B, D + 1, 20], top_logprobs [B, D + 1, 20] (zeros otherwise).

Penalties work on float32 logits (as vLLM's do); the probability arithmetic is float64 (onnxruntime's CPU kernels
support it): an inverse-CDF draw over ~50k tokens in float32 would carry cumulative rounding of ~1e-3 into the
tail. Conditional branches keep the common cases cheap: all rows greedy with nothing to adjust is an argmax; the
penalties, the float64 distribution, the full sort and the logprobs run only when some row needs them.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

TOP_LOGPROBS = 20  # the most alternatives a request may ask for (SamplingParams.logprobs)
# top-k / top-p look at this many most likely tokens first (a partial sort, far cheaper than sorting the whole
# vocabulary: docs/measurements.md); the whole vocabulary is sorted only when a cut may fall beyond them
CANDIDATES = 256
INPUT_NAMES = [
    "logits",
    "tokens",
    "parents",
    "ancestors",
    "uniforms",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "output_counts",
    "prompt_tokens",
    "banned",
    "ban_depth",
    "want_logprobs",
    "logit_bias",
]
OUTPUT_NAMES = ["tokens_out", "count", "path", "logprobs", "top_ids", "top_logprobs"]


def adjust(logits, tokens, ancestors, output_counts, prompt_tokens, repetition, presence, frequency, banned, ban_depth):
    """Penalties where some row has them, then the banned tokens at nodes shallower than ban_depth."""
    penalised = ((repetition != 1.0) | (presence != 0.0) | (frequency != 0.0)).any()
    operands = (
        logits,
        tokens,
        ancestors,
        output_counts,
        prompt_tokens,
        repetition,
        presence,
        frequency,
        banned,
        ban_depth,
    )
    return torch.cond(penalised, penalise_and_ban, ban, operands)


def penalise_and_ban(
    logits, tokens, ancestors, output_counts, prompt_tokens, repetition, presence, frequency, banned, ban_depth
):
    """vLLM's penalties at every node: repetition over prompt + history (divide positive logits, multiply negative
    ones), presence and frequency over the history, the history of node n being the output so far plus the drafts
    on its path down to n itself (n's logits choose the token after n's)."""
    nodes, vocab = logits.shape[1], logits.shape[2]
    path = ancestors & (torch.arange(nodes) > 0)  # the root's token is already in the output
    counts = output_counts.unsqueeze(1) + path.float() @ nn.functional.one_hot(tokens, vocab).float()  # [B, N, V]
    seen = prompt_tokens.unsqueeze(1) | (counts > 0)
    repetition = repetition[:, None, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    logits = logits - frequency[:, None, None] * counts - presence[:, None, None] * (counts > 0).float()
    return ban(
        logits, tokens, ancestors, output_counts, prompt_tokens, repetition, presence, frequency, banned, ban_depth
    )


def ban(logits, tokens, ancestors, output_counts, prompt_tokens, repetition, presence, frequency, banned, ban_depth):
    depth = ancestors.sum(-1) - 1
    return logits.masked_fill(banned.unsqueeze(1) & (depth < ban_depth.unsqueeze(1)).unsqueeze(-1), float("-inf"))


def filtered(scaled, top_k, top_p, candidates: int):
    """top-k and top-p (float64). From the `candidates` most likely tokens (a partial sort) when every cut falls
    among them: every top_k within the candidates, and the candidates' mass reaching every top_p (the nucleus then
    ends among them); otherwise over the whole sorted vocabulary."""
    values, order = torch.topk(scaled, min(candidates, scaled.shape[-1]), dim=-1)  # onnx TopK: ties in token order
    k = top_k[:, None, None].expand(-1, scaled.shape[1], 1)
    kth = torch.where(k > 0, values.gather(-1, k.clamp(1, values.shape[-1]) - 1), float("-inf"))
    masked = scaled.masked_fill(scaled < kth, float("-inf"))  # top-k; ties with the k-th kept
    mass = (values.masked_fill(values < kth, float("-inf")) - masked.logsumexp(-1, keepdim=True)).exp().sum(-1)
    enough = (top_k <= values.shape[-1]).all() & ((mass >= top_p[:, None]) | (top_p >= 1.0)[:, None]).all()
    return torch.cond(enough, candidate_nucleus, sorted_nucleus, (masked, order, top_p, scaled, top_k))


def candidate_nucleus(masked, order, top_p, scaled, top_k):
    """The smallest most-likely set whose mass reaches top_p (the token that crosses it included; equal
    probabilities in token order), found among the candidates `order`."""
    probs = torch.softmax(masked, dim=-1)
    ranked = probs.gather(-1, order)
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(
        -1, order, ranked.cumsum(-1) - ranked < top_p[:, None, None]
    )
    probs = torch.where((top_p < 1.0)[:, None, None] & ~keep, 0.0, probs)
    return probs / probs.sum(-1, keepdim=True)


def sorted_nucleus(masked, order, top_p, scaled, top_k):
    """The same over the whole vocabulary, sorted."""
    vocab = scaled.shape[-1]
    ordered, order = torch.topk(scaled, vocab, dim=-1)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)[:, None, None].expand(-1, scaled.shape[1], 1)
    probs = torch.softmax(scaled.masked_fill(scaled < ordered.gather(-1, k - 1), float("-inf")), dim=-1)
    ranked = probs.gather(-1, order)  # descending: the top-k mask removed only the tail
    keep_ranked = (ranked.cumsum(-1) - ranked < top_p[:, None, None]) | (top_p >= 1.0)[:, None, None]
    keep = torch.zeros_like(keep_ranked).scatter(-1, order, keep_ranked)
    probs = probs.masked_fill(~keep, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def unfiltered(scaled, top_k, top_p):
    return torch.softmax(scaled, dim=-1)


def distribution(adjusted, temperature, top_k, top_p, min_p, candidates: int):
    """q at every node (float64): temperature, top-k, top-p, min-p; a point mass on the argmax where greedy."""
    greedy = temperature == 0.0
    scaled = adjusted.double() / torch.where(greedy, 1.0, temperature.double())[:, None, None]
    top_p = top_p.double()
    filtering = ((top_k > 0) | (top_p < 1.0)).any()
    probs = torch.cond(
        filtering, functools.partial(filtered, candidates=candidates), unfiltered, (scaled, top_k, top_p)
    )
    probs = torch.cond((min_p > 0.0).any(), min_p_filter, unchanged, (probs, min_p))
    return torch.cond(greedy.any(), point_masses, unchanged, (probs, greedy))


def min_p_filter(probs, min_p):
    probs = probs.masked_fill(probs < min_p.double()[:, None, None] * probs.amax(-1, keepdim=True), 0.0)
    return probs / probs.sum(-1, keepdim=True)


def point_masses(probs, greedy):
    """Greedy rows in a batch that samples: a point mass on the argmax."""
    return torch.where(greedy[:, None, None], nn.functional.one_hot(probs.argmax(-1), probs.shape[-1]).double(), probs)


def unchanged(probs, _):
    return probs.clone()


def greedy_choice(adjusted, temperature, top_k, top_p, min_p, tokens, parents, uniforms, candidates: int):
    """Every row greedy: a child is accepted iff it is its parent's argmax; a node draws its argmax."""
    best = adjusted.argmax(-1)  # [B, N]
    test = (parents >= 0) & (tokens == best.gather(1, parents.clamp(min=0)))
    return test, best


def sampled_choice(adjusted, temperature, top_k, top_p, min_p, tokens, parents, uniforms, candidates: int):
    """q at every node, then modified rejection sampling at every node at once (see the module docstring)."""
    batch, nodes, vocab = adjusted.shape
    probs = distribution(adjusted, temperature, top_k, top_p, min_p, candidates)
    flat = probs.reshape(batch, nodes * vocab)
    q_draft = flat.gather(1, parents.clamp(min=0) * vocab + tokens)  # q at the parent, of each node's token
    is_draft = parents >= 0
    index = torch.arange(nodes)
    earlier = (parents.unsqueeze(2) == parents.unsqueeze(1)) & (index[None, :] < index[:, None]) & is_draft.unsqueeze(1)
    mass_before = (earlier.double() @ q_draft.unsqueeze(-1)).squeeze(-1)  # S_c
    test = is_draft & (uniforms[..., 0].double() * (1.0 - mass_before) < q_draft)
    # a node's draw excludes its children's tokens (they were rejected if the walk stops there): each draft marks
    # its token in its parent's row (an add, so marks at the same place cannot race; non-drafts add 0)
    slot = parents.clamp(min=0) * vocab + tokens
    marked = torch.zeros_like(flat).scatter_add(1, slot, is_draft.double()) > 0
    residual = flat.masked_fill(marked, 0.0).reshape(batch, nodes, vocab)
    cdf = residual.cumsum(-1)
    target = uniforms[..., 1].double() * cdf[..., -1]
    drawn = (cdf <= target.unsqueeze(-1)).sum(-1).clamp(max=vocab - 1)  # inverse CDF (searchsorted, side right)
    return test, drawn


def choose(adjusted, temperature, top_k, top_p, min_p, tokens, parents, uniforms, candidates: int):
    operands = (adjusted, temperature, top_k, top_p, min_p, tokens, parents, uniforms)
    greedy, sampled = (functools.partial(f, candidates=candidates) for f in (greedy_choice, sampled_choice))
    return torch.cond((temperature == 0.0).all(), greedy, sampled, operands)


def general_choice(
    logits,
    tokens,
    parents,
    ancestors,
    uniforms,
    temperature,
    top_k,
    top_p,
    min_p,
    repetition,
    presence,
    frequency,
    output_counts,
    prompt_tokens,
    banned,
    ban_depth,
    candidates: int,
):
    adjusted = adjust(
        logits, tokens, ancestors, output_counts, prompt_tokens, repetition, presence, frequency, banned, ban_depth
    )
    return choose(adjusted, temperature, top_k, top_p, min_p, tokens, parents, uniforms, candidates)


def greedy_unpenalised_choice(
    logits,
    tokens,
    parents,
    ancestors,
    uniforms,
    temperature,
    top_k,
    top_p,
    min_p,
    repetition,
    presence,
    frequency,
    output_counts,
    prompt_tokens,
    banned,
    ban_depth,
    candidates: int,
):
    """The common case in one branch: every row greedy, no penalties (bans still apply)."""
    adjusted = ban(
        logits, tokens, ancestors, output_counts, prompt_tokens, repetition, presence, frequency, banned, ban_depth
    )
    return greedy_choice(adjusted, temperature, top_k, top_p, min_p, tokens, parents, uniforms, candidates)


def model_logprobs(logits, path, emitted):
    """log-softmax of the raw logits where each emitted token was chosen: the token's value and the top ones."""
    batch, steps = path.shape
    at_path = logits.gather(1, path.unsqueeze(-1).expand(batch, steps, logits.shape[-1])).double()
    logprobs = torch.log_softmax(at_path, dim=-1)
    top_values, top_ids = torch.topk(logprobs, TOP_LOGPROBS, dim=-1)
    return logprobs.gather(-1, emitted.unsqueeze(-1)).squeeze(-1).float(), top_ids, top_values.float()


def no_logprobs(logits, path, emitted):
    batch, steps = path.shape
    zeros = torch.zeros(batch, steps, TOP_LOGPROBS)
    return torch.zeros(batch, steps), zeros.long(), zeros


class Sampler(nn.Module):
    def __init__(self, max_depth: int, candidates: int = CANDIDATES) -> None:
        super().__init__()
        self.max_depth = max_depth  # accepted drafts per step at most: the walk is unrolled this deep
        self.candidates = candidates

    def forward(
        self,
        logits,
        tokens,
        parents,
        ancestors,
        uniforms,
        temperature,
        top_k,
        top_p,
        min_p,
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
        output_counts,
        prompt_tokens,
        banned,
        ban_depth,
        want_logprobs,
        logit_bias,
    ):
        batch, nodes, _ = logits.shape
        raw_logits, logits = logits, logits + logit_bias.unsqueeze(1)  # logprobs stay the model's own
        children = parents.unsqueeze(1) == torch.arange(nodes)[None, :, None]  # [B, n, c]: c is a child of n
        penalised = ((repetition_penalty != 1.0) | (presence_penalty != 0.0) | (frequency_penalty != 0.0)).any()
        fast, general = (
            functools.partial(f, candidates=self.candidates) for f in (greedy_unpenalised_choice, general_choice)
        )
        test, drawn = torch.cond(
            (temperature == 0.0).all() & ~penalised,
            fast,
            general,
            (
                logits,
                tokens,
                parents,
                ancestors,
                uniforms,
                temperature,
                top_k,
                top_p,
                min_p,
                repetition_penalty,
                presence_penalty,
                frequency_penalty,
                output_counts,
                prompt_tokens,
                banned,
                ban_depth,
            ),
        )

        # each node's accepted child: its first child whose test passed (-1: none)
        passed = (children & test.unsqueeze(1)).long()
        earlier_passed = passed.cumsum(-1) - passed
        first = children & test.unsqueeze(1) & (earlier_passed == 0)
        accepted_child = torch.where(first.any(-1), first.long().argmax(-1), -1)

        node = torch.zeros(batch, dtype=torch.long)
        alive = torch.ones(batch, dtype=torch.bool)
        path, count = [node], torch.ones(batch, dtype=torch.long)
        for _ in range(self.max_depth):
            following = accepted_child.gather(1, node.unsqueeze(1)).squeeze(1)
            alive = alive & (following >= 0)
            node = torch.where(alive, following, node)
            path.append(node)
            count = count + alive.long()
        path = torch.stack(path, dim=1)  # [B, D + 1]
        emitted = torch.cat((tokens.gather(1, path[:, 1:]), torch.zeros(batch, 1, dtype=torch.long)), dim=1)
        emitted = emitted.scatter(1, (count - 1).unsqueeze(1), drawn.gather(1, node.unsqueeze(1)))
        logprobs, top_ids, top_logprobs = torch.cond(
            want_logprobs, model_logprobs, no_logprobs, (raw_logits, path, emitted)
        )
        return emitted, count, path, logprobs, top_ids, top_logprobs
