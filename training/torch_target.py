"""The target answering and scoring in PyTorch on any device (a GPU where one is lent), for `train-drafter --device`.

The engine generates at a few hundred tokens per second on a 2-core CPU, which caps the training data of a draft
head at a few thousand answers per hour. Here the builder's own model (builder/model.py, the code every engine is
exported from, in plain torch ops) runs on `device` in float32 from the checkpoint's weights, a batch of prompts at a
time with a static KV cache: greedy answers, and the final hidden state at every position of them in the same pass
(the state a float32 engine would score them with). Answers are the float32 model's, which is what an fp32 engine
gives and what a quantized engine gives where it agrees with it.
"""

from __future__ import annotations

import tempfile
from functools import cached_property
from pathlib import Path

import numpy as np
import torch


class TorchTargetAnswers:
    """Same contract as training.drafter.TargetAnswers: `traces(prompts, max_new_tokens) -> (traces, tokens)`."""

    def __init__(self, checkpoint: str, device: str, batch_size: int = 512) -> None:
        self.checkpoint, self.device, self.batch_size = checkpoint, torch.device(device), batch_size

    @cached_property
    def loaded(self):
        """(checkpoint, the float32 model on the device, the text codec), loaded when the first answer is needed."""
        from builder.loaders import load_checkpoint
        from builder.weights import load_model
        from engines.format import TokenizerInfo
        from runner.core.tokenizer import TextCodec

        checkpoint = load_checkpoint(self.checkpoint)
        model = load_model(checkpoint.config, checkpoint.read_tensors(), torch.float32)
        model.use_torch_ops()  # attention and norms in plain torch ops, which run on any device
        model = model.to(self.device).eval()
        spec = checkpoint.tokenizer
        with tempfile.TemporaryDirectory() as scratch:
            tokenizer_file = Path(scratch) / "tokenizer.json"
            tokenizer_file.write_text(spec.tokenizer_json)
            info = TokenizerInfo(tokenizer_file.name, spec.chat_template, spec.bos_token, spec.eos_token,
                                 spec.add_bos_token)  # fmt: skip
            codec = TextCodec(tokenizer_file, info)
        return checkpoint, model, codec

    @property
    def config(self):
        return self.loaded[0].config

    def prompt_ids(self, prompts: list[str]) -> list[list[int]]:
        codec = self.loaded[2]
        return [codec.encode(codec.apply_chat_template([{"role": "user", "content": p}])) for p in prompts]

    def traces(self, prompts: list[str], max_new_tokens: int):
        from training.drafter import Trace

        ids = self.prompt_ids(prompts)
        # batches of similar prompt lengths waste least on padding; the answers go back in the prompts' order
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        traces: list[Trace | None] = [None] * len(ids)
        generated = 0
        for start in range(0, len(order), self.batch_size):
            picked = order[start : start + self.batch_size]
            for index, (tokens, hidden) in zip(picked, self.greedy([ids[i] for i in picked], max_new_tokens)):
                traces[index] = Trace(tokens, hidden)
                generated += len(tokens) - 1
        return traces, generated

    @torch.inference_mode()
    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Greedy answers to a batch of prompts -> per prompt (its last token + the answer, up to and including an
        end-of-sequence token; the final hidden state after each of those tokens)."""
        _, model, _ = self.loaded
        config, device, batch = model.config, self.device, len(prompts)
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        longest = int(lengths.max())
        cache_len = longest + max_new_tokens
        shape = (batch, config.num_kv_heads, cache_len, config.head_dim)
        keys = [torch.zeros(shape, device=device) for _ in range(config.num_layers)]
        values = [torch.zeros(shape, device=device) for _ in range(config.num_layers)]
        input_ids = torch.zeros((batch, longest), dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            input_ids[row, : len(prompt)] = torch.tensor(prompt)
        # the prompt in one call (right-padded: padding tokens write nothing), logits of each row's last token
        _, token, hidden, *_ = model(
            input_ids,
            torch.arange(longest, device=device).expand(batch, -1),
            torch.zeros(batch, dtype=torch.long, device=device),
            lengths,
            torch.zeros((batch, 1, longest, longest), device=device),
            (lengths - 1)[:, None],
            keys,
            values,
        )
        tokens, states = [input_ids.gather(1, (lengths - 1)[:, None])[:, 0], token[:, 0]], [hidden[:, 0]]
        past = lengths.clone()
        ones = torch.ones(batch, dtype=torch.long, device=device)
        # one step more than answer tokens: the hidden state after the last answer token is a training input too
        for _ in range(max_new_tokens):
            _, token, hidden, *_ = model(
                tokens[-1][:, None],
                past[:, None],
                past,
                ones,
                torch.zeros((batch, 1, 1, int(past.max()) + 1), device=device),
                torch.zeros((batch, 1), dtype=torch.long, device=device),
                keys,
                values,
            )
            states.append(hidden[:, 0])
            past += 1
            if len(tokens) <= max_new_tokens:
                tokens.append(token[:, 0])
        tokens = torch.stack(tokens, dim=1).cpu().numpy()  # [B, 1 + max_new_tokens]
        states = torch.stack(states, dim=1).cpu().numpy()
        ended = np.isin(tokens[:, 1:], list(config.eos_token_ids))
        answer_lens = np.where(ended.any(1), ended.argmax(1) + 1, max_new_tokens)
        return [(tokens[r, : n + 1].astype(np.int64), states[r, : n + 1]) for r, n in enumerate(answer_lens)]
