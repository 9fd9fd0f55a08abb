"""Model classes by HF architecture name, and `build_model` to construct one."""

from __future__ import annotations

import torch
from torch import nn

from iterserve.replica.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from iterserve.replica.models.llama import LlamaForCausalLM
from iterserve.replica.ops import Ops

# Qwen2 and Mistral differ from Llama only in config (biases, rope), which ModelConfig parses.
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
}


def build_model(model_config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                ops: Ops) -> nn.Module:
    """An unloaded model (parameters uninitialised); `load_weights` fills it."""
    cls = MODEL_REGISTRY.get(model_config.architecture)
    if cls is None:
        raise ValueError(f"unsupported architecture {model_config.architecture!r}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return cls(model_config, dtype, device, ops).eval()


__all__ = ["MODEL_REGISTRY", "ModelConfig", "build_model", "LlamaForCausalLM"]
