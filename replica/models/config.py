"""ModelConfig: the fields of an HF config.json that a Llama-family decoder needs.

Parses both spellings transformers has written: `rope_theta` + `rope_scaling` (4.x) and
`rope_parameters` (5.x). Anything the model cannot honour raises ValueError here, at load
time, rather than producing wrong logits later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """Context-extension parameters. rope_type "default" means no scaling."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int | None = None  # llama3 only

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None, max_position_embeddings: int) -> RopeScaling:
        if not raw:
            return cls()
        rope_type = raw.get("rope_type", raw.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
            )
        if rope_type == "default":
            return cls()
        factor = float(raw.get("factor", 1.0))
        if factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {factor}")
        if rope_type == "linear":
            return cls(rope_type="linear", factor=factor)
        missing = [k for k in ("low_freq_factor", "high_freq_factor") if k not in raw]
        if missing:
            raise ValueError(f"llama3 rope scaling is missing {', '.join(missing)}")
        low, high = float(raw["low_freq_factor"]), float(raw["high_freq_factor"])
        if high <= low:
            raise ValueError(f"llama3 rope scaling needs high_freq_factor ({high}) > "
                             f"low_freq_factor ({low})")
        original = int(raw.get("original_max_position_embeddings", max_position_embeddings))
        return cls("llama3", factor, low, high, original)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (always on for Qwen2)
    o_proj_bias: bool  # Llama's attention_bias also covers o_proj; Qwen2's does not
    mlp_bias: bool
    sliding_window: int | None  # None when the model attends to its whole context
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim",
                    "max_position_embeddings")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse an HF config.json dict; ValueError names any unsupported or missing field."""
        architectures = raw.get("architectures") or []
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {architectures or '(none given)'}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in raw]
        if missing:
            raise ValueError(f"config.json is missing {', '.join(missing)}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r}; only silu")
        heads = int(raw["num_attention_heads"])
        max_pos = int(raw.get("max_position_embeddings", 2048))
        rope = dict(raw.get("rope_parameters") or {})
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = RopeScaling.from_dict(raw.get("rope_scaling") or rope or None, max_pos)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        llama_bias = bool(raw.get("attention_bias", False)) and arch == "LlamaForCausalLM"
        eos = raw.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or llama_bias,
            o_proj_bias=llama_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
            sliding_window=_sliding_window(raw, is_qwen2),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(eos),
        )

    def verify_max_model_len(self, max_model_len: int) -> None:
        """ValueError if the engine's max_model_len needs behaviour this model lacks."""
        if self.sliding_window is not None and self.sliding_window < max_model_len:
            raise ValueError(
                f"this model uses sliding-window attention (window {self.sliding_window}), "
                f"which iterserve does not implement; set max_model_len <= {self.sliding_window}"
            )
        if max_model_len > self.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({max_model_len}) exceeds the model's "
                f"max_position_embeddings ({self.max_position_embeddings})"
            )


def _sliding_window(raw: dict[str, Any], is_qwen2: bool) -> int | None:
    # Qwen2 configs carry a sliding_window value even when use_sliding_window is false.
    if is_qwen2 and not raw.get("use_sliding_window", False):
        return None
    window = raw.get("sliding_window")
    return int(window) if window else None


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    """HF writes token ids as an int, a list of ints, or null."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
