"""Per-request sampling parameters, validated where they enter.

Names and defaults follow vLLM's SamplingParams. The sampling itself runs in the engine's sampler graph
(builder/sampler_graph.py, fed by runner/core/sampler_graph.py); every request owns a seeded generator whose uniforms
it takes, so a
seed gives the same output whatever else runs in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runner.sampling.structured import StructuredOutputs


@dataclass
class SamplingParams:
    max_tokens: int = 16  # 0: only compute the prompt (for its prompt_logprobs), generate nothing
    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 or 0 = no limit
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or output
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    logprobs: int | None = None  # return the sampled token's logprob and this many top alternatives
    prompt_logprobs: int | None = None  # also each prompt token's logprob (from the second on) and this many top ones
    n: int = 1  # completions per prompt (the server's `n`)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit before anything else
    structured_outputs: StructuredOutputs | None = None  # a JSON schema, any JSON, a regex or a choice (structured.py)
    allowed_token_ids: list[int] | None = None  # only these tokens may be generated
    bad_words: list[str] = field(
        default_factory=list
    )  # words never generated (runner/sampling/bad_words.py: vLLM's rule)
    include_stop_str_in_output: bool = False  # the text ends with the stop string (or stop token) that ended it
    skip_special_tokens: bool = True  # special tokens (<|im_end|>, ...) are left out of the text
    # vLLM's; the engines' tokenizers (the `tokenizers` library's fast ones) never put spaces around special tokens,
    # as vLLM's fast detokenizer does not, so either value gives the same text
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: as many as the engine takes)
    detokenize: bool = True  # False: token ids only, the text stays "" (vLLM's; stop strings need the text)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        problems = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            problems.append(f"max_tokens must be an integer >= 1 (0: compute the prompt only), got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            problems.append(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            problems.append(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            problems.append(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            problems.append(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= max(self.max_tokens, 0):
            problems.append(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append("stop must be a list of non-empty strings")
        if not isinstance(self.repetition_penalty, (int, float)) or not 0.0 < self.repetition_penalty <= 10.0:
            problems.append(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                problems.append(f"{name} must be in [-2, 2], got {value!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            problems.append(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= 20
        ):
            problems.append(f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        if not isinstance(self.n, int) or not 1 <= self.n <= 16:
            problems.append(f"n must be an integer in [1, 16], got {self.n!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            problems.append("stop_token_ids must be non-negative integers")
        self.logit_bias = dict(self.logit_bias or {})
        if any(not isinstance(t, int) or t < 0 for t in self.logit_bias):
            problems.append("logit_bias keys must be non-negative token ids")
        if any(not isinstance(v, (int, float)) or not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
            problems.append("logit_bias values must be in [-100, 100]")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            problems.append("structured_outputs must be a StructuredOutputs")
        elif self.structured_outputs is not None and self.min_tokens:
            problems.append(
                "min_tokens cannot be combined with structured outputs (the grammar says where the output ends)"
            )
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids):
                problems.append("allowed_token_ids must be a non-empty list of non-negative token ids")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            problems.append("bad_words must be a list of non-blank strings")
        masks = [name for name in ("structured_outputs", "allowed_token_ids", "bad_words") if getattr(self, name)]
        if len(masks) > 1:
            problems.append(f"{' and '.join(masks)} cannot be combined: together they could leave no token to generate")
        for name in (
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "detokenize",
        ):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.detokenize is False and self.stop:
            problems.append(
                "stop strings need detokenize=True: they are matched in the text (stop_token_ids need no text)"
            )
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (
            not isinstance(truncate, int) or isinstance(truncate, bool) or not (truncate == -1 or truncate >= 1)
        ):
            problems.append(
                f"truncate_prompt_tokens must be -1 (the engine's limit) or an integer >= 1, got {truncate!r}"
            )
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether repetition / presence / frequency penalties change the logits."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
