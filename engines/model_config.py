"""The architecture of a Llama-family model, as the builder reads it and the artifact records it.

It lives in `engines` because it is part of the artifact contract: the runner reads it from the manifest without
importing the builder.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style frequency scaling (the only kind Llama-family checkpoints use besides none)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q, k and v projections
    mlp_bias: bool = False
    o_proj_bias: bool = False  # Llama's attention_bias covers o_proj too; Qwen2 biases q, k, v only
    # attention sees at most this many positions back (Mistral, Qwen2 with use_sliding_window); None: all. The
    # engine attends to every cached position, so the builder refuses a --max-seq-len beyond it
    sliding_window: int | None = None
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's q and k (before the rotary embedding)
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        data = dict(data)
        if data.get("rope_scaling") is not None:
            data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
        data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
        return cls(**data)
