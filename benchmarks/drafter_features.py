"""Does a ReDrafter head draft better from several of the target's layers than from its last hidden state alone?

EAGLE-3 feeds its drafter the target's features from a low, a middle and the top layer, concatenated and projected
to the hidden size. This trains two heads on the same answers, with the same loss, schedule and seed, and measures
both on the validation answers (templates and topics training never saw):

- `last`: the shipped design, the final (normed) hidden state h_t;
- `layers`: [residual stream after each of --layers ; h_t], projected by a learned Linear to the hidden size, then
  the same recurrent head.

    python benchmarks/drafter_features.py --checkpoint default --prompts 1000 --layers 3,15 --epochs 3

The answers come from the builder's model in PyTorch float32 (training/torch_target.py) on --device. The engine
does not export layer features, so a `layers` head is measured here only; it goes into an engine once it measures
better. Writes the acceptance tables and timings as JSON.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click
import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import source_commit  # noqa: E402
from engines.format import tree_shape_key  # noqa: E402


def layer_traces(target, prompts: list[str], max_new_tokens: int, layers: list[int], batch: int):
    """The target's greedy answers with, per position, [stream after each of `layers` ; final hidden]."""
    from training.drafter import Trace

    _, model, _ = target.loaded
    captured: list[list[torch.Tensor]] = [[] for _ in layers]

    def hook(slot):
        def keep(module, inputs, output):
            captured[slot].append((output[0] + output[1]).detach())

        return keep

    handles = [model.model.layers[i].register_forward_hook(hook(slot)) for slot, i in enumerate(layers)]
    traces = []
    try:
        ids = target.prompt_ids(prompts)
        for start in range(0, len(ids), batch):
            chunk = ids[start : start + batch]
            for slot in captured:
                slot.clear()
            answers = target.greedy(chunk, max_new_tokens)
            last = torch.tensor([len(p) - 1 for p in chunk])
            streams = []
            for slot in captured:  # the prompt call (every prompt position), then one call per answer token
                first = slot[0][torch.arange(len(chunk)), last]
                streams.append(torch.stack([first] + [step[:, 0] for step in slot[1:]], dim=1).float().numpy())
            for row, (tokens, hidden) in enumerate(answers):
                n = len(tokens)
                features = [s[row, :n] for s in streams] + [hidden]
                traces.append(Trace(tokens, np.concatenate(features, axis=1)))
    finally:
        for handle in handles:
            handle.remove()
    return traces


class LayerFeatureHead(nn.Module):
    """A recurrent head whose h is a learned projection of the concatenated layer features."""

    def __init__(self, head, width_in: int) -> None:
        super().__init__()
        self.head = head
        self.features = nn.Linear(width_in, head.config.hidden_size)
        self.config = head.config
        self.draft_to_target, self.target_to_draft = head.draft_to_target, head.target_to_draft

    def teacher_forced(self, hidden: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        return self.head.teacher_forced(self.features(hidden), inputs)


def train_and_measure(head, inputs_of, train, held, draft_ids, draft_table, options, log) -> dict:
    """The trainer's loss and schedule (training/drafter.py), then the validation acceptance table."""
    from training.drafter import accepted_drafts, first_draft_accuracy, fit_epochs

    recurrent = head.head if isinstance(head, LayerFeatureHead) else head
    recurrent.dropout.p = options.dropout
    begin = time.perf_counter()
    for epoch, loss in enumerate(fit_epochs(options, head, train, draft_ids, draft_table, False)):
        log(f"      epoch {epoch + 1}: loss {loss:.3f}")
    head.eval()
    hidden, inputs, labels = held
    with torch.no_grad():
        projected = inputs_of(hidden)
    table = {
        tree_shape_key(w, k): round(
            1.0 + accepted_drafts(recurrent, projected, inputs, labels, w, k).float().mean().item(), 3
        )
        for w, k in ((1, 1), (2, 2), (3, 2), (2, 3), (3, 4), (4, 4))
    }
    return {
        "validation_tokens_per_step": {shape: round(value, 3) for shape, value in table.items()},
        "first_draft_accuracy_validation": round(first_draft_accuracy(recurrent, projected, inputs, labels), 4),
        "parameters_m": round(sum(p.numel() for p in head.parameters()) / 1e6, 2),
        "training_seconds": round(time.perf_counter() - begin, 1),
    }


@click.command()
@click.option("--checkpoint", default="default", show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--prompts", type=int, default=1000, show_default=True)
@click.option("--validation", type=int, default=40, show_default=True)
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--layers", default="3,15", show_default=True, help="Layers whose output stream joins the final state.")
@click.option("--epochs", type=int, default=3, show_default=True)
@click.option("--draft-vocab", type=int, default=4096, show_default=True)
@click.option("--generate-batch", type=int, default=64, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=ROOT / "benchmarks/results/drafter_features.json")
def main(checkpoint, device, prompts, validation, max_new_tokens, layers, epochs, draft_vocab, generate_batch, out):
    from builder.speculation.draft_head import DraftHead, DraftHeadConfig
    from builder.speculation.drafter_prompts import drafter_prompts, validation_prompts
    from runner.core.machine import cpu_model
    from training.drafter import (
        DrafterTrainingOptions,
        draft_labels,
        draft_vocabulary,
        target_tables,
        training_examples,
    )
    from training.torch_target import TorchTargetAnswers

    log = lambda line: click.echo(line, err=True)  # noqa: E731
    layer_ids = [int(x) for x in layers.split(",")]
    target = TorchTargetAnswers(checkpoint, device)
    config = target.config
    width = config.hidden_size
    begin = time.perf_counter()
    held_traces = layer_traces(target, validation_prompts(validation), max_new_tokens, layer_ids, generate_batch)
    train_traces = layer_traces(target, drafter_prompts(prompts), max_new_tokens, layer_ids, generate_batch)
    generation = time.perf_counter() - begin
    log(f"{len(train_traces)} + {len(held_traces)} answers in {generation:.0f} s")

    options = DrafterTrainingOptions(Path(checkpoint), out, epochs=epochs, draft_vocab=draft_vocab)
    vocab = min(draft_vocab, config.vocab_size)
    embedding, lm_head = target_tables(target.loaded[0].source, config.tie_word_embeddings)
    train = training_examples(train_traces, options.horizon)
    held = training_examples(held_traces, options.horizon)
    results = {}
    for name in ("last", "layers"):
        torch.manual_seed(options.seed)
        head = DraftHead(DraftHeadConfig(width, config.vocab_size, vocab, options.num_blocks))
        head.set_vocabulary(draft_vocabulary(train_traces, vocab, config.vocab_size))
        head.init_from_target(embedding)
        lm_rows = lm_head[head.draft_to_target]
        if name == "last":  # only the final state: the last `width` columns
            keep = slice(-width, None)
            model, inputs_of, table = head, (lambda h: h), lm_rows
        else:
            keep = slice(None)
            model = LayerFeatureHead(head, train.hidden.shape[1])
            inputs_of = model.features
            # the soft targets read the final state, the last `width` columns: zeros for the layer features
            table = torch.cat((torch.zeros(len(lm_rows), train.hidden.shape[1] - width), lm_rows), dim=1)
        examples = type(train)(train.hidden[:, keep].contiguous(), train.rows, train.inputs, train.labels, train.future)
        split = held.take(torch.arange(len(held)))
        split = (split[0][:, keep], split[1], split[2])
        labels = draft_labels(head, train.labels)
        log(f"[{name}] training on {len(examples)} positions")
        results[name] = train_and_measure(model, inputs_of, examples, split, labels, table, options, log)
        log(f"[{name}] {results[name]}")
    record = {
        "commit": source_commit(),
        "machine": {"cpu": cpu_model(), "threads": torch.get_num_threads()},
        "checkpoint": checkpoint,
        "device": device,
        "layers": layer_ids,
        "prompts": prompts,
        "validation_prompts": validation,
        "answer_positions": len(train),
        "validation_positions": len(held),
        "generation_seconds": round(generation, 1),
        "epochs": epochs,
        "heads": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    click.echo(json.dumps(record["heads"], indent=2))


if __name__ == "__main__":
    main()
