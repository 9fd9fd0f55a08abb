"""A Llama-family decoder (Llama 2/3, Qwen2, Mistral) over the paged KV cache.

One flat batch: T tokens of S sequences back to back, laid out by AttentionMetadata. q/k/v
and gate/up are fused into one matmul each; checkpoints' separate HF tensors are stacked into
them at load time (`load_weights`). Every kernel comes from `ops`, so the same class runs the
torch reference on CPU and the Triton kernels on CUDA.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

from iterserve.replica.attention_metadata import AttentionMetadata
from iterserve.replica.models.config import ModelConfig
from iterserve.replica.models.layers import Embedding, Linear, RMSNormWeight
from iterserve.replica.models.rope import cos_sin_cache
from iterserve.replica.ops import Ops

KVCache = tuple[torch.Tensor, torch.Tensor]  # k_cache, v_cache: [N, B, Hkv, D] each

# HF tensor suffix -> (our fused parameter suffix, shard index within it).
STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class WeightSource(Protocol):
    """A weight that writes itself into its parameter (no dense copy of it in between)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def write_into(self, dest: torch.Tensor) -> None: ...

class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim**-0.5
        if ops.name == "triton":  # refuse an unsupported head_dim at engine start, not mid-step
            from iterserve.kernels.ops import check_head_dim

            check_head_dim(cfg.head_dim)
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size,
                               cfg.attention_bias, dtype, device)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, cfg.o_proj_bias, dtype, device)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]
        kv_cache: KVCache,
        attn: AttentionMetadata,
        cos_sin: torch.Tensor,  # [P, D] float32
    ) -> torch.Tensor:  # [T, H]
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, (Hq + 2 Hkv) D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # Strided views into qkv, no copies: every launcher (and reference op) takes strides,
        # and rotary writes through the views into qkv.
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        self.ops.rotary_embedding(positions, q, k, cos_sin)
        k_cache, v_cache = kv_cache
        self.ops.write_kv_cache(k, v, k_cache, v_cache, attn.slot_mapping)
        out = self.ops.paged_attention(q, k_cache, v_cache, attn.query_start_loc, attn.seq_lens,
                                       attn.block_tables, self.scale, num_decodes=attn.num_decodes,
                                       num_kv_splits=attn.num_kv_splits,
                                       split_work=attn.split_work,
                                       prefill_work=attn.prefill_work)  # [T, Hq, D]
        return self.o_proj(out.view(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias,
                                   dtype, device)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias,
                                dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))  # via [T, 2I], [T, I]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.self_attn = LlamaAttention(cfg, dtype, device, ops)
        self.mlp = LlamaMLP(cfg, dtype, device, ops)
        self.input_layernorm = RMSNormWeight(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNormWeight(cfg.hidden_size, cfg.rms_norm_eps,
                                                      dtype, device)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H], this layer's input before the residual add
        residual: torch.Tensor | None,  # [T, H]; None for the first layer
        kv_cache: KVCache,
        attn: AttentionMetadata,
        cos_sin: torch.Tensor,  # [P, D]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # mlp output [T, H], residual stream [T, H]
        # The residual add is fused into the next norm, so each layer hands on its output and
        # the running residual separately (as vLLM does).
        norm = self.input_layernorm
        if residual is None:
            residual = hidden
            hidden = self.ops.rms_norm(hidden, norm.weight, norm.eps)
        else:
            hidden, residual = self.ops.fused_add_rms_norm(hidden, residual, norm.weight, norm.eps)
        hidden = self.self_attn(positions, hidden, kv_cache, attn, cos_sin)
        norm = self.post_attention_layernorm
        hidden, residual = self.ops.fused_add_rms_norm(hidden, residual, norm.weight, norm.eps)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, dtype, device, ops) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNormWeight(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class LlamaForCausalLM(nn.Module):
    """forward -> final hidden states; compute_logits -> fp32 logits of selected rows."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 ops: Ops) -> None:
        super().__init__()
        self.config = cfg
        self.ops = ops
        self.model = LlamaModel(cfg, dtype, device, ops)
        if cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype, "meta")
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype, device)
        # fp32 whatever the model dtype: positions up to 128k need the precision.
        table = cos_sin_cache(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                              cfg.max_position_embeddings, device)
        self.register_buffer("cos_sin_cache", table, persistent=False)  # [P, D]

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[KVCache],  # one per layer
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"expected {len(self.model.layers)} KV caches (one per layer), "
                             f"got {len(kv_caches)}")
        hidden = self.model.embed_tokens(input_ids)  # [T, H]
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, attn,
                                     self.cos_sin_cache)
        norm = self.model.norm
        if residual is None:  # a model with zero layers cannot exist; kept for the type
            return self.ops.rms_norm(hidden, norm.weight, norm.eps)
        hidden, _ = self.ops.fused_add_rms_norm(hidden, residual, norm.weight, norm.eps)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, H] -> [S, V] fp32
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | WeightSource]]) -> None:
        """Copy HF-named tensors in, stacking q/k/v and gate/up into the fused projections.
        A `WeightSource` (a GGUF tensor) writes itself into its destination instead.

        Tensors the model does not use (rotary inv_freq, a tied lm_head) are skipped.
        ValueError names a tensor of the wrong shape, or every expected tensor never seen.
        """
        params = dict(self.named_parameters())
        expected = set(hf_weight_names(self.config))
        seen: set[str] = set()
        for name, tensor in weights:
            if name not in expected:
                continue
            target, dest = self._destination(name, params)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(dest.shape)} (for {target})")
            if isinstance(tensor, torch.Tensor):
                dest.copy_(tensor)
            else:
                tensor.write_into(dest)
            seen.add(name)
        missing = sorted(expected - seen)
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8
                                              else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")

    def _destination(self, name: str, params: dict[str, nn.Parameter]
                     ) -> tuple[str, torch.Tensor]:
        """The parameter (or the rows of a fused one) that HF tensor `name` fills."""
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in STACKED:
                fused, shard = STACKED[part]
                target = ".".join(parts[:i] + [fused] + parts[i + 1:])
                sizes = self._shard_sizes(fused)
                start = sum(sizes[:shard])
                return target, params[target].data.narrow(0, start, sizes[shard])
        return name, params[name].data

    def _shard_sizes(self, fused: str) -> list[int]:
        cfg = self.config
        if fused == "qkv_proj":
            return [cfg.q_size, cfg.kv_size, cfg.kv_size]
        return [cfg.intermediate_size, cfg.intermediate_size]


def hf_weight_names(cfg: ModelConfig) -> list[str]:
    """Every tensor name an HF checkpoint of this config must hold."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{i}."
        names += [prefix + "input_layernorm.weight", prefix + "post_attention_layernorm.weight"]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names.append(f"{prefix}self_attn.{proj}.weight")
            has_bias = cfg.o_proj_bias if proj == "o_proj" else cfg.attention_bias
            if has_bias:
                names.append(f"{prefix}self_attn.{proj}.bias")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names.append(f"{prefix}mlp.{proj}.weight")
            if cfg.mlp_bias:
                names.append(f"{prefix}mlp.{proj}.bias")
    return names
