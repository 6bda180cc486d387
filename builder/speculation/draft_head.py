"""The ReDrafter draft head (Apple's Recurrent Drafting) and its beam search, written for export.

A recurrent network proposes the tokens after the target's next one. With h the target's last hidden state (fixed
for the whole draft) and g_{t-1} the previous token:

    s_t = SiLU(W e(g_{t-1}) + U s_{t-1}),  s_0 = 0
    draft logits_t = E_d . blocks(Linear([h ; s_t]))      blocks: residual SiLU-Linear

For a small target the vocabulary projection dominates a draft step, so the head works over a reduced,
frequency-ranked draft vocabulary of `draft_vocab` tokens (the target's most frequent outputs): `e` and `E_d` are one
tied table of those tokens' embeddings (initialised from the target's), plus one row for "any other token" as input.
Tokens outside the draft vocabulary are never proposed; they cost acceptance, not correctness.

`BeamSearchDrafter` is the draft graph: from (h, the token the target just emitted) it runs a beam search of
`beam_width` beams over `draft_len` steps (only beam 0 live on the first step, beams ranked by cumulative
log-probability) and returns the beams as target token ids. Every step is unrolled, so the graph has fixed shapes
except the batch.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from plugins.quant_linear import QuantizedLinear, QuantSpec


@dataclass(frozen=True)
class DraftHeadConfig:
    hidden_size: int  # the target's hidden size
    target_vocab_size: int
    draft_vocab_size: int  # tokens the head can propose (the target's most frequent outputs)
    num_blocks: int = 2  # residual SiLU-Linear blocks after the input projection


class DraftHead(nn.Module):
    def __init__(self, config: DraftHeadConfig) -> None:
        super().__init__()
        self.config = config
        width = config.hidden_size
        # rows 0..draft_vocab-1: the draft vocabulary (input embedding and output projection, tied);
        # row draft_vocab: the input embedding of every other token
        self.embed = nn.Embedding(config.draft_vocab_size + 1, width)
        self.rnn_input = nn.Linear(width, width)  # W (its bias is the recurrence's bias)
        self.rnn_state = nn.Linear(width, width, bias=False)  # U
        self.head_in = nn.Linear(2 * width, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(config.num_blocks))
        self.output: nn.Module | None = None  # a quantized copy of the table for the projection (see `quantize`)
        self.dropout = nn.Dropout(0.0)  # on [h ; s] while training (set by the trainer); gone in the exported graph
        # draft token index -> target token id, and target token id -> draft input row
        self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer(
            "target_to_draft", torch.full((config.target_vocab_size,), config.draft_vocab_size, dtype=torch.long)
        )

    def set_vocabulary(self, target_ids: torch.Tensor) -> None:
        """Use these target tokens (most frequent first) as the draft vocabulary."""
        target_ids = target_ids.to(torch.long)
        if target_ids.numel() != self.config.draft_vocab_size or target_ids.unique().numel() != target_ids.numel():
            raise ValueError(f"the draft vocabulary needs {self.config.draft_vocab_size} distinct token ids")
        self.draft_to_target.copy_(target_ids)
        self.target_to_draft.fill_(self.config.draft_vocab_size)
        self.target_to_draft[target_ids] = torch.arange(target_ids.numel())

    def init_from_target(self, target_embedding: torch.Tensor) -> None:
        """Start from the target's own token embeddings (rows of the draft vocabulary, their mean for the rest)."""
        with torch.no_grad():
            rows = target_embedding[self.draft_to_target].float()
            self.embed.weight[:-1] = rows
            self.embed.weight[-1] = target_embedding.float().mean(0)

    def quantize(self, spec: QuantSpec) -> DraftHead:
        """For export: every linear, and the output projection, as a fused quantized matmul (a draft step is as
        memory-bound as a target step: fp32 reads 9.4 MB of table per step). The float table stays for input
        lookups. Drafts only propose: exactness does not depend on them, only acceptance does."""
        for name in ("rnn_input", "rnn_state", "head_in"):
            setattr(self, name, _quantized(getattr(self, name).weight, getattr(self, name).bias, spec))
        self.blocks = nn.ModuleList(_quantized(block.weight, block.bias, spec) for block in self.blocks)
        self.output = _quantized(self.embed.weight, None, spec)
        return self

    def step(
        self, hidden: torch.Tensor, state: torch.Tensor, draft_token: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One recurrence step: (h, s_{t-1}, draft row of g_{t-1}) -> (s_t, draft log-probs over the draft vocab)."""
        state = nn.functional.silu(self.rnn_input(self.embed(draft_token)) + self.rnn_state(state))
        x = self.head_in(self.dropout(torch.cat((hidden, state), dim=-1)))
        for block in self.blocks:
            x = x + nn.functional.silu(block(x))
        # against the whole table, then drop the "other token" column: slicing the table would copy it every step
        logits = (self.output(x) if self.output is not None else nn.functional.linear(x, self.embed.weight))[..., :-1]
        return state, torch.log_softmax(logits.float(), dim=-1)

    def teacher_forced(self, hidden: torch.Tensor, input_tokens: torch.Tensor) -> torch.Tensor:
        """Training: hidden [N, C], target-token inputs [N, K] (g_0 .. g_{K-1}) -> draft log-probs [N, K, Vd]."""
        state = torch.zeros_like(hidden)
        draft_inputs = self.target_to_draft[input_tokens]
        out = []
        for k in range(input_tokens.shape[1]):
            state, logprobs = self.step(hidden, state, draft_inputs[:, k])
            out.append(logprobs)
        return torch.stack(out, dim=1)


def _quantized(weight: torch.Tensor, bias: torch.Tensor | None, spec: QuantSpec) -> QuantizedLinear:
    layer = QuantizedLinear(weight.shape[1], weight.shape[0], bias is not None, torch.float32, spec)
    layer.load_rows(0, weight.detach().float())
    if bias is not None:
        layer.bias.data.copy_(bias.detach())
    return layer


class BeamSearchDrafter(nn.Module):
    """The draft graph: hidden [B, C] + last token [B] -> beams [B, W, K] (target ids) and the log-probability the
    head gives each beam's first k tokens, k = 1..K [B, W, K] (the runner leaves unlikely nodes out of the tree)."""

    def __init__(self, head: DraftHead, beam_width: int, draft_len: int) -> None:
        super().__init__()
        if not 1 <= beam_width <= head.config.draft_vocab_size or draft_len < 1:
            raise ValueError("beam width must be in [1, draft vocab] and draft length at least 1")
        self.head = head
        self.beam_width = beam_width
        self.draft_len = draft_len

    def forward(self, hidden: torch.Tensor, last_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        head, width = self.head, self.beam_width
        batch, channels = hidden.shape
        vocab = head.config.draft_vocab_size
        state, logprobs = head.step(hidden, torch.zeros_like(hidden), head.target_to_draft[last_token])
        scores, tokens = torch.topk(logprobs, width, dim=-1)  # the first step grows beam 0 only
        beams = tokens.unsqueeze(-1)  # [B, W, 1] draft indices
        prefix_scores = scores.unsqueeze(-1)  # [B, W, 1] log-probability of each beam's first k tokens
        state = state.unsqueeze(1).expand(batch, width, channels)
        beam_hidden = hidden.unsqueeze(1).expand(batch, width, channels)
        for _ in range(self.draft_len - 1):
            state, logprobs = head.step(beam_hidden, state, beams[:, :, -1])
            candidates = (scores.unsqueeze(-1) + logprobs).reshape(batch, width * vocab)
            scores, flat = torch.topk(candidates, width, dim=-1)
            parent = torch.div(flat, vocab, rounding_mode="floor")
            history = parent.unsqueeze(-1).expand(-1, -1, beams.shape[-1])
            beams = torch.cat((torch.gather(beams, 1, history), (flat - parent * vocab).unsqueeze(-1)), dim=-1)
            prefix_scores = torch.cat((torch.gather(prefix_scores, 1, history), scores.unsqueeze(-1)), dim=-1)
            state = torch.gather(state, 1, parent.unsqueeze(-1).expand(-1, -1, channels))
        return head.draft_to_target[beams], prefix_scores


def save_draft_head(head: DraftHead, path: Path, metadata: dict | None = None) -> None:
    """One safetensors file: the weights in fp16 (a drafter needs no more), the config and training facts as text.
    The head may be on any device. The file is replaced whole: a reader never sees half of it."""
    from safetensors.torch import save_file

    tensors = {
        name: (t.half() if t.is_floating_point() else t).cpu().contiguous() for name, t in head.state_dict().items()
    }
    info = {"config": json.dumps(asdict(head.config)), "format": "redrafter-head-v1"}
    info.update({key: json.dumps(value) for key, value in (metadata or {}).items()})
    partial = path.with_name(path.name + ".partial")
    save_file(tensors, str(partial), metadata=info)
    os.replace(partial, path)


def load_draft_head(path: str | Path) -> tuple[DraftHead, dict]:
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"draft head not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as handle:
            info = handle.metadata() or {}
            if info.get("format") != "redrafter-head-v1":
                raise ValueError(f"{path} is not a draft head written by `builder train-drafter`")
            head = DraftHead(DraftHeadConfig(**json.loads(info["config"])))
            state = {name: handle.get_tensor(name) for name in handle.keys()}
    except SafetensorError as err:
        raise ValueError(f"{path} is not a readable safetensors file: {err}") from None
    head.load_state_dict({name: t.float() if t.is_floating_point() else t for name, t in state.items()})
    extra = {key: json.loads(value) for key, value in info.items() if key not in ("config", "format")}
    return head.eval(), extra
