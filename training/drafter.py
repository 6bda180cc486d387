"""`builder train-drafter`: distil a ReDrafter draft head from a built target engine's own greedy answers.

1. The target engine answers the shipped chat prompts (builder/speculation/drafter_prompts.py) greedily, batched
   through the runner's inflight batching, a shard of prompts at a time.
2. A `score` phase gives the target's final hidden state at every position of prompt + answer: the target's own, or
   that of a scoring engine of the same weights (an fp32 engine where the target quantizes, so the distillation
   targets carry no rounding while the quantized target generates fast).
3. At every answer position t, the head sees (h_t, the target's next token x_{t+1}) and learns to predict
   x_{t+2} .. x_{t+1+horizon} (teacher forcing, dropout on its input), over a draft vocabulary of the target's most
   frequent output tokens, starting from the target's own embeddings. The loss mixes cross-entropy on the target's
   greedy tokens with distillation: cross-entropy against the target's whole next-token distribution at each of
   those positions, which its stored hidden states give for the price of one matmul with its LM head.
4. On the answers to validation prompts (templates and topics training never saw) it measures after every epoch
   the greedy acceptance the engine would see: beam search from (h_t, x_{t+1}), the longest beam prefix equal to
   the target's continuation, plus the target's own token; the best epoch's head is kept.

Answers and hidden states can be kept in a traces directory (`traces`), one file per shard of prompts: a stopped
collection resumes at its first missing shard, a larger prompt set reuses the shards of a smaller one, and other
training settings reuse them all.

With `device` set, the target is a checkpoint instead of an engine: the builder's model in PyTorch answers, scores
and trains on that device (training/torch_target.py), which on a GPU makes tens of thousands of answers a matter of
minutes.

This tool sits above both halves of the project: it runs the target through the runner (the engine is the
target) and writes a head the builder folds into a speculative engine.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from builder.speculation.draft_head import BeamSearchDrafter, DraftHead, DraftHeadConfig, save_draft_head
from builder.speculation.drafter_prompts import drafter_prompts, validation_prompts
from engines.format import tree_shape_key

IGNORE = -100


@dataclass(frozen=True)
class DrafterTrainingOptions:
    engine: Path
    out: Path
    prompts: int = 1200
    validation: int = 40  # validation prompts (unseen templates and topics)
    max_new_tokens: int = 128
    draft_vocab: int = 4096
    horizon: int = 4  # draft tokens trained per position (an engine may draft fewer)
    num_blocks: int = 2
    epochs: int = 6
    batch_size: int = 256
    learning_rate: float = 2e-3
    dropout: float = 0.1
    # weight of the soft loss: cross-entropy against the target's own next-token distribution at each drafted
    # position (its final hidden state through its LM head, over the draft vocabulary), the rest on the
    # target's greedy token; 0 trains on the greedy tokens alone (0.5 and 1.0 both beat 0 on held-out prompts)
    distill: float = 1.0
    beam_width: int = 3  # for the validation acceptance that picks the best epoch
    seed: int = 0
    threads: int | None = None
    checkpoint: str | None = None  # where the target's embeddings come from (default: the engine's source)
    traces: Path | None = None  # directory of answer + hidden-state shards: those present are read, the rest written
    shard_size: int = 256  # prompts per shard (the unit a killed collection resumes from)
    score_engine: Path | None = None  # engine of the same model that gives the hidden states (default: `engine`)
    bf16: bool | None = None  # train the head's matmuls in bfloat16 autocast (None: where the CPU has native bf16)
    # a torch device ("cuda", "cpu"): `engine` is then a checkpoint, answered and scored by the builder's model in
    # float32 on that device, where the head trains too; None: `engine` is a built engine, the head trains on CPU
    device: str | None = None
    generate_batch: int = 512  # prompts answered together on `device`

    def __post_init__(self) -> None:
        if not 0.0 <= self.distill <= 1.0:
            raise ValueError(f"distill is the soft loss's weight, between 0 and 1; got {self.distill}")
        if self.device is not None and self.score_engine is not None:
            raise ValueError("with --device the float32 model scores its own answers; --score-engine takes an engine")


@dataclass(frozen=True)
class Trace:
    """One answer: tokens[0] is the prompt's last token, hidden[i] the target's state after tokens[i] (it predicts
    tokens[i + 1])."""

    tokens: np.ndarray  # [n] int64
    hidden: np.ndarray  # [n, hidden] float32


class TraceStore:
    """Answers and hidden states kept on disk, one file per shard of prompts, so a long collection resumes where it
    stopped and a larger prompt set reuses the shards it shares with a smaller one.

    `key` names the target engine, the scoring engine and the answer length; each shard also records a digest of its
    own prompt texts, so an edited prompt set is never trained on answers to the old one."""

    def __init__(self, directory: Path, key: str) -> None:
        self.directory = Path(directory)
        if self.directory.is_file():
            raise ValueError(f"{directory} is a file; --traces takes a directory (a trace file from an older version)")
        self.directory.mkdir(parents=True, exist_ok=True)
        meta = self.directory / "traces.json"
        if meta.is_file():
            stored = json.loads(meta.read_text())["key"]
            if stored != key:
                raise ValueError(
                    f"{directory} holds traces of another engine or answer length ({stored}); "
                    "delete it or pass another --traces"
                )
        else:
            meta.write_text(json.dumps({"key": key}) + "\n")

    def _path(self, group: str, index: int) -> Path:
        return self.directory / f"{group}-{index:05d}.npz"

    def read(self, group: str, index: int, prompts: list[str]) -> list[Trace] | None:
        path = self._path(group, index)
        if not path.is_file():
            return None
        data = np.load(path)
        if str(data["prompts"]) != _digest(prompts):
            raise ValueError(
                f"{path} holds answers to other prompts (the prompt set changed); delete {self.directory} or pass "
                "another --traces"
            )
        bounds = np.cumsum(np.concatenate(([0], data["lengths"])))
        tokens, hidden = data["tokens"], data["hidden"]
        return [Trace(tokens[a:b], hidden[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]

    def write(self, group: str, index: int, prompts: list[str], traces: list[Trace]) -> None:
        path = self._path(group, index)
        partial = path.with_name(path.stem + ".partial.npz")  # renamed whole, so a killed run leaves no half shard
        np.savez(
            partial,
            prompts=np.array(_digest(prompts)),
            lengths=np.array([len(t.tokens) for t in traces]),
            tokens=np.concatenate([t.tokens for t in traces]),
            hidden=np.concatenate([t.hidden for t in traces]).astype(np.float16),
        )
        partial.replace(path)


def _digest(texts: list[str]) -> str:
    return hashlib.sha256(json.dumps(texts).encode()).hexdigest()[:16]


class TargetAnswers:
    """The target engine answering prompts greedily (batched through the runner's inflight batching), and the
    engine that scores the answers: the target's hidden state at every position of prompt + answer, the head's
    inputs and, through the LM head, its distillation targets. The scorer defaults to the target itself; an fp32
    engine of the same weights gives unrounded states while a quantized target generates fast."""

    def __init__(self, engine: Path, score_engine: Path | None, threads: int | None) -> None:
        self.engine, self.score_engine, self.threads = engine, score_engine, threads

    @cached_property
    def engines(self):
        """(target LLM, scoring LLM), loaded when the first answer is needed (a run that reads every shard back
        loads neither)."""
        from runner.llm import LLM

        target = LLM(self.engine, threads=self.threads)
        scorer = target if self.score_engine is None else LLM(self.score_engine, threads=self.threads)
        if scorer.engine.manifest.model != target.engine.manifest.model:
            raise ValueError(f"{self.score_engine} is another model than {self.engine}: it cannot score its answers")
        return target, scorer

    def traces(self, prompts: list[str], max_new_tokens: int) -> tuple[list[Trace], int]:
        """-> (one Trace per prompt, answer tokens generated)."""
        from runner.sampling.params import SamplingParams

        target, scorer = self.engines
        texts = [target.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        outputs = target.generate(texts, SamplingParams(max_tokens=max_new_tokens, temperature=0.0))
        executor = scorer.engine.executor
        traces = []
        for output in outputs:
            tokens = output.prompt_token_ids + output.token_ids
            hidden = np.concatenate([scored.hidden for scored in executor.score_chunks(tokens)])
            first = len(output.prompt_token_ids) - 1
            traces.append(Trace(np.asarray(tokens[first:], np.int64), hidden[first:].astype(np.float32)))
        executor.cache.release()
        return traces, sum(len(o.token_ids) for o in outputs)


def progress_line(done: int, total: int, tokens_per_second: float, eta_seconds: float | None, width: int = 24) -> str:
    """`[#########---------------]  37%  3,072/8,300 answers, 412 tok/s, ETA 21 min` (no ETA known yet: `ETA --`)."""
    filled = min(width, round(width * done / total)) if total else width
    eta = "--" if eta_seconds is None else f"{eta_seconds / 60:.0f} min"
    return (
        f"[{'#' * filled}{'-' * (width - filled)}] {done / max(total, 1):4.0%}  {done:,}/{total:,} answers, "
        f"{tokens_per_second:,.0f} tok/s, ETA {eta}"
    )


def collect_traces(
    answers: TargetAnswers,
    groups: dict[str, list[str]],
    max_new_tokens: int,
    shard_size: int,
    store: TraceStore | None,
    log: Callable[[str], None],
) -> dict[str, list[Trace]]:
    """Every group's traces, shard by shard: read from `store` where it has them, else generated (and written there),
    with a progress line and an ETA after each shard."""
    total = sum(len(prompts) for prompts in groups.values())
    done = generated = 0
    full_shards, full_seconds = 0, 0.0  # this run's whole shards, the pace the ETA extrapolates
    collected = {}
    for group, prompts in groups.items():
        collected[group] = []
        for index, start in enumerate(range(0, len(prompts), shard_size)):
            shard = prompts[start : start + shard_size]
            traces = None if store is None else store.read(group, index, shard)
            if traces is None:
                begin = time.perf_counter()
                traces, tokens = answers.traces(shard, max_new_tokens)
                seconds = time.perf_counter() - begin
                generated += len(shard)
                if store is not None:
                    store.write(group, index, shard, traces)
                # Only whole shards set the pace: a short one (the validation prompts, a group's last) leaves most of
                # a batch idle and took nearly a whole shard's time. Shards read back took no time.
                if len(shard) == shard_size:
                    full_shards, full_seconds = full_shards + 1, full_seconds + seconds
                eta = (total - done - len(shard)) / shard_size * full_seconds / full_shards if full_shards else None
                log(f"      {progress_line(done + len(shard), total, tokens / seconds, eta)}")
            collected[group] += traces
            done += len(shard)
    if store is not None and generated < total:
        log(f"      {total - generated:,} of {total:,} answers read back from {store.directory}")
    return collected


def draft_vocabulary(traces: list[Trace], size: int, target_vocab: int) -> torch.Tensor:
    """The `size` most frequent answer tokens (ties by id), topped up with the lowest unused ids if too few."""
    counts = Counter(int(t) for trace in traces for t in trace.tokens[1:])
    ranked = [token for token, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))][:size]
    seen = set(ranked)
    ranked += [t for t in range(target_vocab) if t not in seen][: size - len(ranked)]
    return torch.tensor(ranked, dtype=torch.long)


@dataclass(frozen=True)
class Examples:
    """Teacher-forced positions: rows index `hidden` (every trace's states, concatenated)."""

    hidden: torch.Tensor  # [states, C]
    rows: torch.Tensor  # [N] the state h_t each example drafts from
    inputs: torch.Tensor  # [N, horizon] x_{t+1} .. (0 past the end)
    labels: torch.Tensor  # [N, horizon] x_{t+2} .. (IGNORE past the end)
    future: torch.Tensor  # [N, horizon] the state that predicts each label (h_{t+1} ..; 0 past the end)

    def __len__(self) -> int:
        return len(self.rows)

    def to(self, device: torch.device) -> Examples:
        return Examples(*(getattr(self, name).to(device) for name in ("hidden", "rows", "inputs", "labels", "future")))

    def take(self, pick: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.hidden[self.rows[pick]], self.inputs[pick], self.labels[pick]


def training_examples(traces: list[Trace], horizon: int) -> Examples:
    """Every answer position t but the last: h_t, inputs x_{t+1} .., labels x_{t+2} .. and their states (numpy
    gathers over all traces at once: a GPU-sized collection has millions of positions)."""
    lengths = np.array([len(t.tokens) for t in traces])
    # each trace's tokens followed by horizon + 1 IGNOREs, so every window stays inside its own trace
    padded = np.concatenate([np.concatenate((t.tokens, np.full(horizon + 1, IGNORE, np.int64))) for t in traces])
    padded_start = np.concatenate(([0], np.cumsum(lengths + horizon + 1)[:-1]))
    state_start = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    trace = np.repeat(np.arange(len(traces)), lengths - 1)
    t = np.concatenate([np.arange(n - 1) for n in lengths])
    ahead = np.arange(horizon)
    window = (padded_start[trace] + t)[:, None] + ahead
    rows = state_start[trace] + t
    inputs, labels = padded[window + 1], padded[window + 2]
    return Examples(
        torch.from_numpy(np.concatenate([t.hidden for t in traces]).astype(np.float32, copy=False)),
        torch.from_numpy(rows),
        torch.from_numpy(np.where(inputs == IGNORE, 0, inputs)),
        torch.from_numpy(labels),
        torch.from_numpy(np.where(labels == IGNORE, 0, rows[:, None] + 1 + ahead)),
    )


def draft_labels(head: DraftHead, labels: torch.Tensor) -> torch.Tensor:
    """Target-vocabulary labels as the head's draft-vocabulary ids; IGNORE stays, and so does a token outside the
    draft vocabulary (the head cannot draft it: no loss to learn from)."""
    mapped = torch.where(labels == IGNORE, IGNORE, head.target_to_draft[labels.clamp(min=0)])
    return torch.where(mapped == head.config.draft_vocab_size, IGNORE, mapped)


def accepted_drafts(
    head: DraftHead, hidden: torch.Tensor, inputs: torch.Tensor, labels: torch.Tensor, beam_width: int, draft_len: int
) -> torch.Tensor:
    """Per position, the drafts greedy verification accepts: the longest beam prefix equal to the target's tokens."""
    drafter = BeamSearchDrafter(head, beam_width, draft_len).eval()
    with torch.no_grad():
        beams, _ = drafter(hidden, inputs[:, 0])  # [N, W, K]
    matches = (beams == labels[:, None, :draft_len]).long().cumprod(dim=-1).sum(-1)  # [N, W]
    return matches.max(dim=1).values


def greedy_acceptance(
    head: DraftHead, hidden: torch.Tensor, inputs: torch.Tensor, labels: torch.Tensor, beam_width: int, draft_len: int
) -> float:
    """Mean tokens per verify step under greedy decoding: the accepted drafts + the target's own token."""
    return 1.0 + accepted_drafts(head, hidden, inputs, labels, beam_width, draft_len).float().mean().item()


def acceptance_by_depth(accepted: torch.Tensor, draft_len: int) -> list[float]:
    """For each draft position k = 1..draft_len, the share of steps that accept it given they accepted the k - 1
    before it (the rate a tree's depth-k nodes pay off at)."""
    reached = [(accepted >= k).float().mean().item() for k in range(draft_len + 1)]
    return [round(reached[k] / reached[k - 1], 3) if reached[k - 1] else 0.0 for k in range(1, draft_len + 1)]


def first_draft_accuracy(head: DraftHead, hidden: torch.Tensor, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    """How often the head's first draft token is the target's next-but-one token (teacher forced)."""
    with torch.no_grad():
        best = head.teacher_forced(hidden, inputs[:, :1])[:, 0].argmax(-1)
    valid = labels[:, 0] != IGNORE
    return (head.draft_to_target[best] == labels[:, 0])[valid].float().mean().item()


def _soft_cross_entropy(logprobs: torch.Tensor, target_logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over valid drafted positions of -sum_v p_target(v) log p_draft(v), both over the draft vocabulary."""
    per_position = -(torch.softmax(target_logits.float(), dim=-1) * logprobs).sum(-1)
    return per_position[valid].mean()


def native_bf16() -> bool:
    """bfloat16 matmuls are faster than float32 for the head on a CPU with AVX-512 BF16, slower without it
    (docs/measurements.md)."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(probe and probe())


def target_tables(source: str, tied: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and its LM head's weight (the same table when tied), float32."""
    from builder.loaders import load_checkpoint

    wanted = {"model.embed_tokens.weight"} | (set() if tied else {"lm_head.weight"})
    tables = {name: tensor.float() for name, tensor in load_checkpoint(source).read_tensors() if name in wanted}
    if wanted - tables.keys():
        raise ValueError(f"{source} has no {', '.join(sorted(wanted - tables.keys()))}")
    embedding = tables["model.embed_tokens.weight"]
    return embedding, tables.get("lm_head.weight", embedding)


@dataclass(frozen=True)
class TargetFacts:
    """What training needs to know of the target, from its engine's manifest or its checkpoint."""

    config: object  # engines.model_config.ModelConfig
    source: str  # where its weights (and embeddings) are read
    key: str  # names the answers' generator and scorer in a traces directory


def target_facts(options: DrafterTrainingOptions) -> TargetFacts:
    if options.device is not None:
        from builder.loaders import load_checkpoint

        checkpoint = load_checkpoint(str(options.engine))
        key = f"{checkpoint.source}|{_weights_digest(checkpoint.source)}|PyTorch float32"
        return TargetFacts(checkpoint.config, checkpoint.source, f"{key}|{options.max_new_tokens} tokens")
    from engines.format import open_artifact

    manifest = open_artifact(options.engine).manifest
    scorer = manifest if options.score_engine is None else open_artifact(options.score_engine).manifest
    key = f"{_engine_key(manifest)}|scored by {_engine_key(scorer)}|{options.max_new_tokens} tokens"
    return TargetFacts(manifest.model, manifest.source, key)


def _weights_digest(source: str) -> str:
    """A digest of a checkpoint's weight files (a GGUF, or an HF directory's safetensors)."""
    path = Path(source)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def train_drafter(options: DrafterTrainingOptions, log: Callable[[str], None] = print) -> dict:
    """Distil a head from the target's answers (or the traces file) and write it with its training record."""
    torch.manual_seed(options.seed)
    target = target_facts(options)
    begin = time.perf_counter()
    groups = _target_traces(options, target, log)
    train_traces, held_traces = groups["train"], groups["validation"]
    device = torch.device(options.device or "cpu")
    head, draft_table = _new_head(options, target, train_traces, held_traces, log)
    head, draft_table = head.to(device), draft_table.to(device)
    vocab_size = head.config.draft_vocab_size

    train = training_examples(train_traces, options.horizon).to(device)
    labels = draft_labels(head, train.labels)
    held = training_examples(held_traces, options.horizon).to(device)
    held_split = held.take(torch.arange(len(held), device=device))
    log(
        f"[2/3] training on {len(train)} positions ({len(held)} for validation), "
        f"{sum(p.numel() for p in head.parameters()) / 1e6:.2f} M parameters"
    )
    probe = torch.randperm(len(train), device=device)[:4096]  # training positions the fit is measured on
    splits = {"train": train.take(probe), "validation": held_split}
    accuracy = {f"{name}_before": first_draft_accuracy(head, *split) for name, split in splits.items()}
    bf16 = (device.type == "cuda" or native_bf16()) if options.bf16 is None else options.bf16
    record = {
        "target": target.source,
        "scored_by": str(options.score_engine or options.engine)
        + ("" if options.device is None else f" (PyTorch float32 on {options.device})"),
        "prompts": options.prompts,
        "validation_prompts": options.validation,
        "answer_tokens": int(sum(len(t.tokens) - 1 for t in train_traces)),
        "epochs": options.epochs,
    }

    def keep_best(epoch: int, losses: list[float]) -> None:
        # written as the run goes, so a run cut short (a lent machine's deadline) leaves its best head so far; its
        # epoch_losses then list fewer epochs than `epochs`
        save_draft_head(head, Path(options.out), {**record, "kept_epoch": epoch, "epoch_losses": losses})

    Path(options.out).parent.mkdir(parents=True, exist_ok=True)
    kept_epoch, epoch_losses = _fit(options, head, train, labels, draft_table, held_split, bf16, keep_best, log)

    accepted = {
        (w, k): accepted_drafts(head, *held_split, w, k) for w in (1, 2, 3, 4) for k in range(1, options.horizon + 1)
    }
    acceptance = {tree_shape_key(w, k): round(1.0 + a.float().mean().item(), 3) for (w, k), a in accepted.items()}
    per_depth = {
        tree_shape_key(w, options.horizon): acceptance_by_depth(accepted[w, options.horizon], options.horizon)
        for w in (1, 2, 3, 4)
    }
    facts = {
        **record,
        "kept_epoch": kept_epoch,
        "epoch_losses": epoch_losses,
        "horizon": options.horizon,
        "dropout": options.dropout,
        "draft_vocab": vocab_size,
        "bf16": bf16,
        "distill": options.distill,
        "validation_tokens_per_step": acceptance,
        "validation_acceptance_by_depth": per_depth,
        "first_draft_accuracy": {
            **{k: round(v, 4) for k, v in accuracy.items()},
            **{f"{name}_after": round(first_draft_accuracy(head, *split), 4) for name, split in splits.items()},
        },
        "seconds": round(time.perf_counter() - begin, 1),
    }
    log(f"[3/3] writing {options.out}")
    save_draft_head(head, Path(options.out), facts)
    return facts


def _target_traces(options: DrafterTrainingOptions, target: TargetFacts, log: Callable[[str], None]) -> dict:
    """The target's answers to the training and validation prompts, with its hidden states: read from the traces
    directory for the shards it holds, the rest generated (and written there)."""
    # validation first: a collection stopped early still has what picks the best epoch
    groups = {"validation": validation_prompts(options.validation), "train": drafter_prompts(options.prompts)}
    store = None if options.traces is None else TraceStore(options.traces, target.key)
    scored_by = "" if options.score_engine is None else f", scored by {options.score_engine}"
    if options.device is not None:
        scored_by = f", PyTorch float32 on {options.device}"
    log(
        f"[1/3] target {options.engine} answers {options.prompts} + {options.validation} validation prompts "
        f"(greedy, {options.max_new_tokens} tokens max{scored_by})"
        + ("" if store is None else f"; shards kept in {options.traces}")
    )
    if options.device is None:
        answers = TargetAnswers(options.engine, options.score_engine, options.threads)
    else:
        from training.torch_target import TorchTargetAnswers

        answers = TorchTargetAnswers(str(options.engine), options.device, options.generate_batch)
    return collect_traces(answers, groups, options.max_new_tokens, options.shard_size, store, log)


def _engine_key(manifest) -> str:
    return f"{manifest.source}|{manifest.files[manifest.graphs['step'].file].sha256[:16]}"


def _new_head(
    options: DrafterTrainingOptions, target: TargetFacts, train_traces: list[Trace], held_traces: list[Trace], log
) -> tuple[DraftHead, torch.Tensor]:
    """A head over the answers' most frequent tokens, started from the target's embeddings, and the target's LM head
    rows of that vocabulary (the soft targets' projection)."""
    config = target.config
    vocab_size = min(options.draft_vocab, config.vocab_size)
    head = DraftHead(DraftHeadConfig(config.hidden_size, config.vocab_size, vocab_size, options.num_blocks))
    head.set_vocabulary(draft_vocabulary(train_traces, vocab_size, config.vocab_size))
    embedding, lm_head = target_tables(options.checkpoint or target.source, config.tie_word_embeddings)
    head.init_from_target(embedding)
    draft_table = lm_head[head.draft_to_target]
    covered = head.target_to_draft < vocab_size
    answer_tokens = torch.from_numpy(np.concatenate([t.tokens[1:] for t in held_traces]))
    log(
        f"      draft vocabulary {vocab_size} tokens covers {covered[answer_tokens].float().mean().item():.1%} of "
        "validation answer tokens"
    )
    return head, draft_table


def _fit(
    options: DrafterTrainingOptions,
    head: DraftHead,
    train: Examples,
    draft_ids: torch.Tensor,
    draft_table: torch.Tensor,
    held_split,
    bf16: bool,
    keep: Callable[[int, list[float]], None],
    log: Callable[[str], None],
) -> tuple[int, list[float]]:
    """Train for the epochs asked and keep the epoch whose head the validation answers accept most of (`keep` is
    told of each new best while the head holds it); -> (that epoch, every epoch's mean loss)."""
    head.dropout.p = options.dropout
    log(f"      matmuls in {'bfloat16 autocast (fp32 weights and softmax)' if bf16 else 'float32'}")
    best = (0.0, None, 0)  # validation tokens per step, weights, epoch
    epoch_losses = []
    for epoch, loss in enumerate(fit_epochs(options, head, train, draft_ids, draft_table, bf16)):
        epoch_losses.append(round(loss, 4))
        head.eval()
        accepted = greedy_acceptance(head, *held_split, options.beam_width, options.horizon)
        log(
            f"      epoch {epoch + 1}/{options.epochs}: loss {loss:.3f}, validation tokens per step "
            f"{accepted:.2f} (beams {options.beam_width} x {options.horizon})"
        )
        if accepted > best[0]:
            best = (accepted, {k: v.clone() for k, v in head.state_dict().items()}, epoch + 1)
            keep(epoch + 1, list(epoch_losses))
    head.load_state_dict(best[1])
    log(f"      kept epoch {best[2]}")
    return best[2], epoch_losses


def fit_epochs(
    options: DrafterTrainingOptions, head, train: Examples, draft_ids, draft_table, bf16: bool
) -> Iterator[float]:
    """AdamW under a one-cycle schedule over `options.epochs` epochs of shuffled batches; yields each epoch's mean
    loss, between epochs (where the caller may measure the head: each epoch sets it training again)."""
    optimizer = torch.optim.AdamW(head.parameters(), lr=options.learning_rate, weight_decay=0.0)
    batches = math.ceil(len(train) / options.batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, options.learning_rate, total_steps=options.epochs * batches
    )
    for _ in range(options.epochs):
        head.train()
        order = torch.randperm(len(train), device=train.rows.device)
        total = 0.0
        for index in range(batches):
            pick = order[index * options.batch_size : (index + 1) * options.batch_size]
            loss = _batch_loss(options, head, train, pick, draft_ids, draft_table, bf16)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            total += loss.item()
        yield total / batches


def _batch_loss(options, head, train: Examples, pick, draft_ids, draft_table, bf16: bool) -> torch.Tensor:
    """Cross-entropy on the target's greedy tokens and against its whole next-token distributions, mixed by
    `distill`."""
    hidden, inputs, labels = train.take(pick)
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16, enabled=bf16):
        logprobs = head.teacher_forced(hidden, inputs)
    loss = torch.zeros((), device=hidden.device)
    if options.distill < 1:
        hard = torch.nn.functional.nll_loss(logprobs.flatten(0, 1), draft_ids[pick].flatten(), ignore_index=IGNORE)
        loss = loss + (1 - options.distill) * hard
    if options.distill > 0:
        soft = _soft_cross_entropy(logprobs, train.hidden[train.future[pick]] @ draft_table.t(), labels != IGNORE)
        loss = loss + options.distill * soft
    return loss
