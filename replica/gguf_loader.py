"""Load a Llama-architecture GGUF file (llama.cpp's format) into the engine's model.

The header is read by `gguf_header.read_gguf_header`: the model config comes from the
`<arch>.*` metadata keys, and the tensor names are mapped to HF's so
`LlamaForCausalLM.load_weights` fills them; each tensor is dequantised straight into its
parameter by `gguf_dequant.write_into` (torch for the common types, ggml-org's
`gguf.quants.dequantize` for the rest). llama.cpp's converter permutes the rows of the Q and
K projections of Llama-style models (it rotates interleaved pairs, HF rotates halves);
`write_into` undoes that while it writes, so the model matches the HF layout. Every
unsupported thing raises ValueError naming it and what is supported; a truncated or corrupt
file fails here, at load, never in the middle of a step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from iterserve.replica.gguf_dequant import write_into
from iterserve.replica.gguf_header import TensorRecord, read_gguf_header
from iterserve.replica.models import ModelConfig, build_model
from iterserve.replica.models.config import RopeScaling
from iterserve.replica.ops import Ops

# GGUF general.architecture -> (HF architecture, whether the converter permuted Q/K rows).
# Qwen2 uses NEOX-style (halves) rotary in llama.cpp too, so its rows are stored as HF's.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
}
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                          "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
GGUF_ROPE_TYPES = {"none": "default", "linear": "linear"}

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFFile:
    """The parsed header of one GGUF file: metadata values and tensor records (memory-mapped;
    read by `gguf_header.read_gguf_header`, 20x faster than gguf's own reader)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {self.path} does not exist")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file (starts with {magic!r}, not b'GGUF')")
        try:
            self.fields, self.tensors, _ = read_gguf_header(self.path)
        except (ValueError, IndexError, KeyError, OSError, OverflowError, UnicodeDecodeError) as e:
            raise ValueError(f"{self.path} is truncated or corrupt; the GGUF reader failed: "
                             f"{type(e).__name__}: {e}") from e

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.path} lacks the metadata key {key!r}")
        return value

    @property
    def architecture(self) -> str:
        arch = self.require("general.architecture")
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {arch!r} in {self.path}; "
                             f"supported: {', '.join(ARCHITECTURES)}")
        return arch


@lru_cache(maxsize=4)
def open_gguf(path: str | Path) -> GGUFFile:
    """One parse per file per process: the config, tokenizer and weights all read the header."""
    return GGUFFile(path)


def gguf_model_config(path: str | Path) -> ModelConfig:
    """ModelConfig from the `<arch>.*` metadata keys."""
    file = open_gguf(path)
    arch = file.architecture
    hf_arch, _ = ARCHITECTURES[arch]
    hidden = int(file.require(f"{arch}.embedding_length"))
    heads = int(file.require(f"{arch}.attention.head_count"))
    kv_heads = int(file.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(file.get(f"{arch}.attention.key_length", hidden // heads))
    vocab = file.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(file.require("tokenizer.ggml.tokens"))
    max_pos = int(file.require(f"{arch}.context_length"))
    if "rope_freqs.weight" in file.tensors:
        raise ValueError(f"{file.path} carries per-dimension rope frequencies (rope_freqs.weight, "
                         "Llama 3.1 style), which the GGUF loader does not support; load the HF "
                         "checkpoint folder instead")
    bias = "blk.0.attn_q.bias" in file.tensors
    eos = file.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=hf_arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(file.require(f"{arch}.feed_forward_length")),
        num_hidden_layers=int(file.require(f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(file.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(file.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(file, arch, max_pos),
        max_position_embeddings=max_pos,
        tie_word_embeddings="output.weight" not in file.tensors,
        attention_bias=bias or arch == "qwen2",
        o_proj_bias="blk.0.attn_output.bias" in file.tensors,
        mlp_bias=False,
        sliding_window=None,
        bos_token_id=file.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _rope_scaling(file: GGUFFile, arch: str, max_pos: int) -> RopeScaling:
    kind = file.get(f"{arch}.rope.scaling.type", "none")
    if kind not in GGUF_ROPE_TYPES:
        raise ValueError(f"unsupported GGUF rope scaling type {kind!r} in {file.path}; "
                         f"supported: {', '.join(GGUF_ROPE_TYPES)}")
    factor = file.get(f"{arch}.rope.scaling.factor")
    if GGUF_ROPE_TYPES[kind] == "default" or factor is None:
        return RopeScaling()
    return RopeScaling.from_dict({"rope_type": "linear", "factor": float(factor)}, max_pos)


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name for a GGUF tensor name, or None for tensors the model does not use."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}"
    return None


@dataclass(frozen=True)
class GGUFWeight:
    """One GGUF tensor waiting to be written into its parameter (`load_weights` calls
    `write_into`): dequantised straight into it, Q/K rows unpermuted on the way (`heads`)."""

    record: TensorRecord
    heads: int | None
    copied: Callable[[int], None] | None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self.record.shape))

    def write_into(self, dest: torch.Tensor) -> None:
        write_into(self.record, dest, self.heads, self.copied)


def iter_gguf_weights(path: str | Path, config: ModelConfig,
                      copied: Callable[[int], None] | None = None
                      ) -> Iterator[tuple[str, GGUFWeight]]:
    """(HF name, GGUFWeight) for every tensor the model uses, in the file's order; an
    unsupported tensor type is a ValueError before anything is written. `copied(nbytes)`
    hears of every dense buffer written besides the parameters."""
    file = open_gguf(path)
    _, permuted = ARCHITECTURES[file.architecture]
    for name, record in file.tensors.items():
        hf_name = hf_tensor_name(name)
        if hf_name is None:
            continue
        kind = record.tensor_type.name
        if kind not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(f"tensor {name!r} in {file.path} has type {kind}, which the GGUF "
                             f"loader does not support; supported: "
                             f"{', '.join(SUPPORTED_TENSOR_TYPES)}")
        heads = None
        if permuted and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = config.num_attention_heads
        elif permuted and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = config.num_key_value_heads
        yield hf_name, GGUFWeight(record, heads, copied)


def load_gguf_checkpoint(path: str | Path, dtype: torch.dtype, device: torch.device | str,
                         ops: Ops, copied: Callable[[int], None] | None = None
                         ) -> tuple[nn.Module, ModelConfig]:
    """Build the model for the GGUF file's metadata and fill it with its dequantized tensors."""
    model_config = gguf_model_config(path)
    model = build_model(model_config, dtype, device, ops)
    with torch.no_grad():
        model.load_weights(iter_gguf_weights(path, model_config, copied))
    return model, model_config
